"""An 8-bit KV cache: each cached K/V vector (one position of one KV head) stored in 8 bits with its own
float32 scale, chosen at export (``--kv-dtype int8|fp8``).

A scale per position and head (not per block) means a position's bytes depend only on its own values:
writing position p never rewrites an earlier one, a prefix block shared by several sessions holds the
same bits whoever wrote it, and the step that writes a position reads back exactly what later steps
will. The scale costs 4 bytes per ``head_dim`` values (3% at 128).

    int8: symmetric, scale = max|x| / 127, q = round-half-even(x / scale);
    fp8:  float8_e4m3fn, scale = max|x| / 448, q = fp8(x / scale) (round to nearest even).

The CUDA kernels (`kernels.decode`, `kernels.prefill`) do the same arithmetic; they read a cached
vector as ``q`` converted to the query's dtype (exact for both formats) and fold the scale into the
scores (K) or the probabilities (V).
"""

from __future__ import annotations

import torch

KV_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
TINY = 1e-30  # an all-zero vector gets this scale over QMAX: its values quantize to 0, no 0/0


def kv_dtype(name: str | None) -> torch.dtype | None:
    """The storage dtype for ``--kv-dtype`` ``name`` (None or "bf16": the model's own dtype)."""
    if name in (None, "bf16"):
        return None
    if name not in KV_DTYPES:
        raise ValueError(f"kv_dtype={name!r}: choose one of {', '.join(KV_DTYPES)} (or bf16, the model's dtype)")
    return KV_DTYPES[name]


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in ``dtype``, float32 scales [...]): one scale per vector."""
    xf = x.float()
    qmax = QMAX[dtype]
    scale = xf.abs().amax(-1).clamp_min(TINY) / qmax
    y = xf / scale[..., None]
    if dtype == torch.int8:
        return y.round().clamp(-qmax, qmax).to(torch.int8), scale
    return y.to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values [..., D] and their scales [...] -> float32 [..., D]."""
    return q.float() * scale[..., None]
