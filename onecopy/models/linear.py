"""How every projection reads its weight, float or packed: `matmul`, and `PackedLinear`, the ``nn.Linear``
whose weight stays packed (its forward is `matmul`).

A packed weight (`packed.Packed`) is read as it is stored by a C++ kernel on the CPU (`kernels.cpu`: float32
rows, groups of 32 and more; other CPU cases dequantize it in the graph), read by the native packed GEMM in a
CUDA prefill where it is tile-ordered (`kernels.native.packed_gemm`, bf16 rows without a bias; else dequantized
for cuBLAS by one kernel, `kernels.dequantize`); a CUDA decode step, and a prefill's LM head on its one row,
instead read it packed inside the small-linear kernel (`projections`, `kernels.small_linear`),
which dequantizes each tile as it goes; a batch-invariant decode reads it through
`invariant.linear_rows`. An ``f8r`` weight takes `packed.fp8_linear` everywhere (CPU and CUDA, any
number of rows).

A module apart from `packed` because it calls `invariant`, which reads weights through `packed`: in
`packed`, the two would import each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..kernels import cpu as cpu_kernels
from ..kernels import native
from . import invariant
from .packed import (ACTIVATION_QUANTIZED, LAYOUT_IDS, MMA_LAYOUT_IDS, Packed, PackedLayer, Weight, dequantize, fp8_linear,
                     kernel_linear)


def matmul(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for a float or a packed weight. On the CPU a packed one is read packed by
    `kernels.cpu.packed_linear` where it serves (else dequantized in the graph). On CUDA a tile-ordered one
    (bf16 rows, no bias) goes through `kernels.native.packed_gemm`; others are dequantized for cuBLAS by one kernel
    (`kernels.dequantize`), except where few rows read
    it: a batch-invariant CUDA decode (`invariant.linear_rows`) and, on CUDA, any product of a fixed
    number of at most `kernels.SMALL_LINEAR_ROWS` rows (a prefill's LM head on its last position), which
    read it packed in the small-linear kernel rather than write and read the whole matrix in x's dtype."""
    if not isinstance(w, Packed):
        return F.linear(x, w, bias)
    if w.layout in ACTIVATION_QUANTIZED:
        return fp8_linear(x, w, bias)
    if invariant.active():
        return invariant.linear_rows(x, w, bias)
    rows = x.reshape(-1, x.shape[-1])
    if cpu_kernels.serves(w.layout, w.group, x):  # CPU: read packed, in C++
        y = cpu_kernels.packed_linear(rows, w.layout, w.group, w.qweight, w.scales, w.mins)
    elif not (x.is_cuda and kernels.available()):
        return F.linear(x, dequantize(w, x.dtype), bias)
    elif isinstance(rows.shape[0], int) and rows.shape[0] <= kernels.SMALL_LINEAR_ROWS:
        y = kernel_linear(rows, w)[0]
    elif w.layout in MMA_LAYOUT_IDS and x.dtype == torch.bfloat16 and bias is None:  # tile-ordered: the packed GEMM
        y = native.packed_gemm(rows, w.qweight, w.scales, w.mins, MMA_LAYOUT_IDS[w.layout], w.group)
    elif w.layout in MMA_LAYOUT_IDS:  # (float16 rows, or a bias: one rounding) the native kernel writes the float copy
        return F.linear(x, native.unpack(w.qweight, w.scales, w.mins, MMA_LAYOUT_IDS[w.layout], w.group, x.dtype), bias)
    else:
        return F.linear(x, kernels.dequantize(w.qweight, w.scales, w.mins, LAYOUT_IDS[w.layout], w.group, x.dtype), bias)
    y = y.reshape(*x.shape[:-1], w.out_features)  # the kernels' rows back in x's shape
    return y if bias is None else y + bias


class PackedLinear(PackedLayer):
    """An ``nn.Linear`` whose weight stays packed (its bias, if any, stays a float parameter)."""

    def __init__(self, w: Packed, bias: torch.Tensor | None = None) -> None:
        super().__init__(w)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias)
