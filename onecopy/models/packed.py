"""Quantized weights kept packed in the model: the operand a layer hands its matmul, and the layers that hold one.

A packed weight [N, K] is ``qweight`` (int8/uint8 values, two 4-bit values per byte for the nibble
layouts), ``scales`` and, for the affine layouts, ``mins`` (float32 [N, K / group]); `layouts.LAYOUTS`
lists the layouts and their arithmetic, `layouts.check_packed` their shapes (a leaf module: the bundle
checks a manifest with it without importing this one); the GGUF repack, `gguf_repack`, and the
export-time quantizer, `quantize`, both produce them. One layout quantizes the activations too: ``f8r`` holds
float8 e4m3 values with one float32 scale per output feature (its group is the whole row, K), and
its layers multiply on the FP8 tensor cores (`fp8_linear`): each row of x is scaled into e4m3 on the
fly, so at a wide batch the GEMM runs at twice the bf16 rate (Hopper, Ada); in a CUDA decode step up to 16 rows
(8 for weights of more than 8192 outputs: `kernels.native.fp8_gemv_rows`) take the native packed GEMV instead
(bf16 rows, the weight's exact values: no quantization). A layer that holds one
(`PackedLayer`: `linear.PackedLinear`, `PackedEmbedding`) keeps the tensors as buffers, so that export
lifts them as constants under FQNs of their own (``<module>.qweight``, ``.scales``, ``.mins``) and the
weight store holds them at their packed size.

How a projection multiplies by its weight, float or packed, is `linear.matmul`: it picks among
`dequantize`, `fp8_linear` and `kernel_linear` here and `invariant.linear_rows` (it lives apart from
this module because `invariant` imports this one). An ``f8r`` weight takes `fp8_linear`
everywhere (CPU and CUDA, any number of rows) but in a CUDA decode step, which `kernel_linear` gives the
native packed op with its folds (`projections.fp8_folds`); it has no batch-invariant kernel, so its
bundles export no batch-invariant decode (`activation_quantized`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import kernels
from ..kernels import native
from ..layouts import F8R_NATIVE_ID, LAYOUT_IDS, LAYOUTS, MMA_LAYOUT_IDS, MMA_LAYOUTS, PACKED_PARTS, check_packed
from .mma_order import PLAIN_LAYOUTS, order_groups, order_values, unorder_groups, unorder_values

ACTIVATION_QUANTIZED = frozenset({"f8r"})  # layouts multiplied by `fp8_linear`, not read by the Triton kernels
FP8_MAX = 448.0  # the largest finite float8 e4m3fn value


class Packed(NamedTuple):
    """A packed weight as a layer hands it to `linear.matmul` (tensors on the model's device). A named tuple:
    traced code (export, ``torch.cond`` branches) builds and reads it like any tuple."""

    layout: str
    group: int
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.qweight.shape[-1] * LAYOUTS[self.layout][0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors, for a ``torch.cond`` operand list (`rebuild` turns them back)."""
        return (self.qweight, self.scales) if self.mins is None else (self.qweight, self.scales, self.mins)

    def rebuild(self, tensors: tuple[torch.Tensor, ...]) -> "Packed":
        return Packed(self.layout, self.group, tensors[0], tensors[1], tensors[2] if len(tensors) > 2 else None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


Weight = torch.Tensor | Packed  # what a projection reads: a float matrix or a packed one


def tile_ordered(w: Packed) -> Packed:
    """``w`` (q4z, q4a or q8s, `mma_order.orderable`) in the native CUDA kernel's tile order (the ``_mma`` layout)."""
    return Packed(MMA_LAYOUTS[w.layout], w.group, order_values(w.qweight, w.layout), order_groups(w.scales),
                  None if w.mins is None else order_groups(w.mins))


def stored_order(w: Packed) -> Packed:
    """``w`` in its stored (row-major) order: a tile-ordered weight turned back, any other as it is. Traceable."""
    if w.layout not in MMA_LAYOUT_IDS:
        return w
    return Packed(PLAIN_LAYOUTS[w.layout], w.group, unorder_values(w.qweight, w.layout), unorder_groups(w.scales),
                  None if w.mins is None else unorder_groups(w.mins))


def dequantize(w: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] in ``dtype``: computed in float32 (s * q exact, one rounding at + m), then
    rounded once to ``dtype``; for a GGUF tensor the float32 is bit for bit gguf's dequantization
    (`gguf_repack`). Traceable: the CPU and prefill graphs dequantize with it (a tile-ordered weight is
    read back to its stored order first)."""
    w = stored_order(w)
    return dequantize_values(w.layout, w.group, w.qweight, w.scales, w.mins, dtype)


def dequantize_values(layout: str, group: int, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`dequantize`'s arithmetic on a stored-order weight's tensors with any leading dims ([..., N, K / values per
    byte] values and [..., N, K / group] scales -> [..., N, K]): a stack of experts, or the rows of it a step
    gathers. Traceable."""
    *lead, kb = qweight.shape
    k = kb * LAYOUTS[layout][0]
    q = qweight
    if LAYOUTS[layout][0] == 2:
        q = torch.stack((q & 0x0F, q >> 4), dim=-1)  # low nibble first: k = 2i, then 2i + 1
    q = q.reshape(*lead, k // group, group).to(torch.float32)
    s = scales.reshape(*lead, k // group, 1)
    if layout == "q4z":
        out = s * (q - 8.0)  # exact small integers; 8 - 8 is +0.0, as gguf's int8 0 is
    elif layout in ("q8s", "f8r"):
        out = s * q
    else:
        assert mins is not None
        out = s * q + mins.reshape(*lead, k // group, 1)  # two ops, as gguf; s * q is exact, so an FMA agrees
    return out.reshape(*lead, k).to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [M, K] in float8 e4m3 and its float32 scale [M, 1] (max |x| / 448, rounded to nearest):
    the dynamic per-token activation quantization of `fp8_linear`. A row of zeros gets a tiny scale, not 0."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s


def fp8_linear(x: torch.Tensor, w: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for an ``f8r`` weight, on the FP8 tensor cores: x's rows quantized to e4m3
    (`quantize_rows`), one ``torch._scaled_mm`` with the row and feature scales, in x's dtype. Each output
    row depends on its input row alone in exact arithmetic, but the GEMM's kernel (its tiles) is cuBLAS's
    or CUTLASS's choice per batch size: not batch-invariant bit for bit.
    On CUDA with the native kernels (`kernels.native.fp8_serves`) one op: up to `fp8_gemv_rows` bf16 rows the packed GEMV,
    which multiplies the rows as they are (no quantization) by the exact bf16 of each e4m3 value and applies
    the feature's scale to the sums (cuBLAS's GEMM at one row was slower than bf16, and an FP8-rows GEMV slower
    than this one), more rows this same quantization and ``_scaled_mm``."""
    rows = x.reshape(-1, x.shape[-1])
    if native.fp8_serves(x):
        y = native.fp8_linear(rows, w.qweight, w.scales)
        y = y.reshape(*x.shape[:-1], w.out_features)
        return y if bias is None else y + bias
    q, s = quantize_rows(rows)
    y = torch._scaled_mm(q, w.qweight.t(), scale_a=s, scale_b=w.scales.reshape(1, -1), out_dtype=x.dtype)
    y = y.reshape(*x.shape[:-1], w.out_features)
    return y if bias is None else y + bias


def fp8_glu_linear(x: torch.Tensor, w: Packed) -> torch.Tensor:
    """`fp8_linear` of the SwiGLU rows ``silu(gate) * up`` of a gate/up output x [..., 2K] and an ``f8r`` weight
    [N, K]: on CUDA (`kernels.native.fp8_serves`) one kernel makes and quantizes the rows (Inductor's SwiGLU
    kernel wrote the products and the quantization read them back); elsewhere the unfused ops."""
    k = w.in_features
    if native.fp8_serves(x):
        y = native.fp8_glu_linear(x.reshape(-1, x.shape[-1]), w.qweight, w.scales)
        return y.reshape(*x.shape[:-1], w.out_features)
    gate, up = x.split([k, k], dim=-1)
    return fp8_linear(torch.nn.functional.silu(gate) * up, w)


def activation_quantized(w: Weight | None) -> bool:
    """True for a weight that `fp8_linear` multiplies (an ``f8r`` one): it never takes a Triton kernel."""
    return isinstance(w, Packed) and w.layout in ACTIVATION_QUANTIZED


def has_activation_quantized(module: nn.Module) -> bool:
    """True when any layer of ``module`` holds an activation-quantized (``f8r``) weight: its decode has no
    batch-invariant form (a deterministic engine runs it one row per call, `runtime.step`)."""
    return any(isinstance(m, PackedLayer) and m.layout in ACTIVATION_QUANTIZED for m in module.modules())


def kernel_linear(x: torch.Tensor, w: Weight, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.small_linear` (same ``options``) of a float or a packed weight, the packed one read as it
    is stored (CUDA only); a tile-ordered one (``_mma``) by the native op (`kernels.native.packed_linear`, the
    same folds; its kernel's rows are batch-invariant in any block of rows, so ``block_m`` does not apply, and
    ``invariant`` keeps the kernel for every batch size)."""
    if isinstance(w, Packed) and w.layout in MMA_LAYOUT_IDS:
        return native.packed_linear(x, w.qweight, w.scales, w.mins, MMA_LAYOUT_IDS[w.layout], w.group,
                                    residual=options.get("residual"), glu=options.get("glu", False),
                                    norm=options.get("norm"), invariant=options.get("invariant", False))
    if isinstance(w, Packed) and w.layout == "f8r":  # (`fp8_folds`: a CUDA decode with the native kernels)
        return native.packed_linear(x, w.qweight, w.scales, None, F8R_NATIVE_ID, w.group,
                                    residual=options.get("residual"), glu=options.get("glu", False),
                                    norm=options.get("norm"))
    if isinstance(w, Packed):
        options["packed"] = (w.scales, w.mins, LAYOUT_IDS[w.layout], w.group)
        w = w.qweight
    return kernels.small_linear(x, w, **options)


def flatten(weights: Sequence[Weight | None]) -> tuple[tuple[torch.Tensor, ...], Callable[[Sequence[torch.Tensor]], list]]:
    """The tensors of ``weights`` (float, packed or None) for a ``torch.cond`` operand list, and the
    function that turns such a list back into the weights. That function closes over layouts, groups
    and counts only: a cond branch must not close over tensors (export would lift them behind the
    store's back)."""
    specs = [None if w is None else (w.layout, w.group, len(w.tensors())) if isinstance(w, Packed) else "float"
             for w in weights]
    flat = tuple(t for w in weights if w is not None for t in (w.tensors() if isinstance(w, Packed) else (w,)))

    def unflatten(tensors: Sequence[torch.Tensor]) -> list:
        out, i = [], 0
        for spec in specs:
            if spec is None:
                out.append(None)
            elif spec == "float":
                out.append(tensors[i])
                i += 1
            else:
                layout, group, n = spec
                out.append(Packed(layout, group, *tensors[i:i + n]))
                i += n
        return out

    return flat, unflatten


def hold_packed(module: nn.Module, layout: str, group: int, shape: tuple[int, ...], qweight: torch.Tensor,
                scales: torch.Tensor, mins: torch.Tensor | None) -> None:
    """Check a packed weight of float ``shape`` (`check_packed`) and hold it in ``module``: ``layout``, ``group``
    and the buffers ``qweight``, ``scales``, ``mins`` (None for the symmetric layouts: not in the state dict)."""
    check_packed(layout, group, shape, qweight, scales, mins)
    module.layout, module.group = layout, group
    module.register_buffer("qweight", qweight)
    module.register_buffer("scales", scales)
    module.register_buffer("mins", mins)


class PackedLayer(nn.Module):
    """A layer whose weight stays packed, held as buffers (the base of `linear.PackedLinear` and `PackedEmbedding`)."""

    def __init__(self, w: Packed) -> None:
        super().__init__()
        hold_packed(self, w.layout, w.group, w.shape, w.qweight, w.scales, w.mins)

    @property
    def weight(self) -> Packed:
        """The packed weight, where a float layer's callers read ``.weight``."""
        return Packed(self.layout, self.group, self.qweight, self.scales, self.mins)

    def extra_repr(self) -> str:
        n, k = self.weight.shape
        return f"{k} -> {n}, {self.layout}, group {self.group}"


class PackedExperts(nn.Module):
    """A stack of experts' weights [E, N, K] kept packed (one ``layout`` weight [N, K] per expert, stored order,
    buffers ``qweight`` [E, N, K / values per byte], ``scales`` and ``mins`` [E, N, K / group]): what a MoE layer
    reads in place of its float [E, N, K] parameter. A decode step dequantizes only the experts its rows chose
    (`rows` with their indices: the gather feeds the dequantization, which feeds the products, and Inductor fuses
    them, so the step reads those experts' packed bytes); a prefill dequantizes the stack once per call."""

    def __init__(self, layout: str, group: int, qweight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None) -> None:
        super().__init__()
        e, n, kb = qweight.shape
        hold_packed(self, layout, group, (e, n, kb * LAYOUTS[layout][0]), qweight, scales, mins)

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, kb = self.qweight.shape
        return (e, n, kb * LAYOUTS[self.layout][0])

    def rows(self, idx: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The float weights of experts ``idx`` (any shape of indices: [*idx.shape, N, K]), or of all ([E, N, K])."""
        q, s, m = self.qweight, self.scales, self.mins
        if idx is not None:
            q, s, m = q[idx], s[idx], None if m is None else m[idx]
        return dequantize_values(self.layout, self.group, q, s, m, dtype)

    def extra_repr(self) -> str:
        e, n, k = self.shape
        return f"{e} experts, {k} -> {n}, {self.layout}, group {self.group}"


def expert_rows(w: torch.Tensor | PackedExperts, idx: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A float [E, N, K] expert parameter's experts ``idx`` (all with None), or a packed one's, dequantized."""
    if isinstance(w, PackedExperts):
        return w.rows(idx, dtype)
    return w if idx is None else w[idx]


class PackedEmbedding(PackedLayer):
    """An ``nn.Embedding`` whose table stays packed: only the looked-up rows are dequantized. ``dtype``:
    the model's (the rows' dtype)."""

    def __init__(self, w: Packed, dtype: torch.dtype) -> None:
        super().__init__(w)
        self.dtype = dtype

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1)
        w = self.weight
        rows = Packed(w.layout, w.group, w.qweight[flat], w.scales[flat], None if w.mins is None else w.mins[flat])
        return dequantize(rows, self.dtype).reshape(*tokens.shape, -1)


def as_float_weights(weights: dict[str, torch.Tensor], packed: dict[str, dict[str, Any]],
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``weights`` (FQN -> tensor) with each packed layer (a manifest's ``packed``) dequantized to
    ``<layer>.weight`` in ``dtype``: what a float model of the same values loads (benchmark peers)."""
    out = dict(weights)
    for name, p in packed.items():
        parts = [out.pop(f"{name}.{part}", None) for part in PACKED_PARTS]
        if len(p["shape"]) == 3:  # a stack of experts (stored order): the model's [E, N, K] parameter
            out[f"{name}"] = dequantize_values(p["layout"], p["group"], *parts, dtype)
        else:
            out[f"{name}.weight"] = dequantize(Packed(p["layout"], p["group"], *parts), dtype)
    return out


def packed_bytes(shape: tuple[int, ...], layout: str, group: int) -> int:
    """Device bytes of a ``layout`` weight of float ``shape`` ([N, K], or [E, N, K] experts): values, float32
    scales and mins."""
    *lead, k = shape
    n = math.prod(lead)
    per_byte, affine = LAYOUTS[layout]
    return n * k // per_byte + (2 if affine else 1) * 4 * n * (k // group)

