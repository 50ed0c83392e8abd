"""Layers the decoder families share: RMSNorm, rotary embeddings (RoPE) and the SwiGLU MLP.

Each follows transformers' op order and dtypes, so that the eager models match transformers and
the compiled methods match the eager ones. The attention over the state pool that the families
share is `attention`; the fused CUDA decode's projections are `projections`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .linear import matmul
from .packed import Weight, activation_quantized, fp8_glu_linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in transformers' op order (normalize in fp32, scale in the model dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    """`rms_norm` with its weight (Llama's: ``w * norm(x)``, the weight initialised to ones)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# ----------------------------------------------------------------------------------------------- RoPE

def rope_inv_freq(cfg: Any, dim: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse RoPE frequencies over ``dim`` (default: the head) and the cos/sin scale for the config's
    scaling variant (``cfg`` needs head_dim, rope_theta, rope_scaling, max_position_embeddings).

    Follows transformers' ``ROPE_INIT_FUNCTIONS`` for default, linear, llama3 and yarn.
    """
    dim = dim or cfg.head_dim
    base = cfg.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(cfg.rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "yarn":
        factor = scaling["factor"]
        old_ctx = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
        beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)
        mscale = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def corr_dim(rot: float) -> float:
            return (dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo = max(math.floor(corr_dim(beta_fast)), 0)
        hi = min(math.ceil(corr_dim(beta_slow)), dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extrapolation = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv, float(mscale)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, yarn")


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype,
                 decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin at ``positions`` (angles in fp32, as transformers computes them), in ``dtype``, shaped
    [B, 1, 1, D] for decode (one position per session), [1, T, 1, D] for a prefill chunk (positions [T])
    or [N, T, 1, D] for N chunks (positions [N, T])."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    if decode:
        return cos[:, None, None, :], sin[:, None, None, :]
    return tuple(c[..., None, :] if positions.dim() == 2 else c[None, :, None, :] for c in (cos, sin))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """RoPE on heads ``x`` [N, T, H, D] with `rope_cos_sin`'s cos, sin; with ``rotary_dim`` < D only the first
    ``rotary_dim`` dims of each head rotate (partial rotary), the rest pass through."""
    if rotary_dim is None or rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


# ----------------------------------------------------------------------------------------------- MLP

def swiglu(x: torch.Tensor, w13: Weight, w2: Weight) -> torch.Tensor:
    """``w2 @ (silu(gate) * up)`` with gate and up the halves of ``x @ w13.T`` (w13 [2I, dim], w2 [dim, I]),
    float or packed (`linear.matmul`).

    A function of its weights, so that a ``torch.cond`` branch can take them as operands (`projections`).
    """
    hidden = w2.shape[1]
    h = matmul(x, w13)
    if activation_quantized(w2):  # FP8: the SwiGLU rows made and quantized in one pass
        return fp8_glu_linear(h, w2)
    gate, up = h.split([hidden, hidden], dim=-1)
    return matmul(F.silu(gate) * up, w2)


class FeedForward(nn.Module):
    """SwiGLU with gate and up fused into one GEMM (w13)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.w13 = nn.Linear(dim, 2 * hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w13.weight, self.w2.weight)
