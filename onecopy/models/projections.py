"""A decode step's projections: one fused kernel per projection for a few rows, torch ops for more.

At batch 1 a decode step is a chain of matrix-vector products, each reading a weight once. cuBLAS
runs them as split-K GEMMs plus a reduction kernel, and the RMSNorm, SwiGLU and residual adds around
them are kernels of their own; `kernels.small_linear` reads each weight once in one kernel with the
SwiGLU or residual add after it and the RMSNorm before it folded in (benchmarks/gemv_cuda.py,
benchmarks/norm_fold_cuda.py). It serves up to `kernels.SMALL_LINEAR_ROWS` rows; wider
batches keep cuBLAS and Inductor's fusions. The choice is a ``torch.cond`` on the batch size, which
the exported method evaluates on the host: each batch size's CUDA graph holds only its branch.
A batch-invariant decode (traced under `invariant.BatchInvariant`) takes none of this: its linears
are `invariant.linear_rows`, its norms apart. A packed (quantized) weight (`packed`) takes the kernel
for any number of rows (`kernel_rows`); so does an FP8 one (``f8r``) where the native op takes it
(`fp8_folds`: its GEMV on bf16 rows up to `native.fp8_gemv_rows`, the rows quantized for the FP8 GEMM between a
norm kernel and a fold kernel past that), else `packed.fp8_linear` for any number of rows, its norms apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .. import kernels
from ..kernels import native
from . import invariant
from .layers import rms_norm
from .linear import matmul
from .packed import Packed, Weight, activation_quantized, flatten, kernel_linear


def fused_decode(x: torch.Tensor, decode: bool) -> bool:
    """Whether a method traced with ``x`` takes the fused path: a decode step on a CUDA device with Triton,
    not batch-invariant: the partial sums of squares a norm fold passes on are reduced in an order that
    depends on the rows per program, so the invariant decode runs its norms apart (`invariant`)."""
    return decode and x.is_cuda and kernels.available() and not invariant.active()


def fp8_folds(x: torch.Tensor) -> bool:
    """Whether a decode step's FP8 (``f8r``) projections of x's rows take the native packed op with its folds, for
    any number of rows as the other packed weights do (`kernel_rows`): bf16 rows on a CUDA sm_89+ GPU with the
    native kernels. Else `packed.fp8_linear` at every size, the norms apart. (Not a ``torch.cond`` on the rows
    with Inductor's ops past 8: tracing such a branch cannot read the context variable `native.fp8_serves` does;
    H200, 16 sessions: 0.88x bf16 this way against 0.95x before, batch 1 1.43x against 1.26x.)"""
    return x.dtype == torch.bfloat16 and native.fp8_serves(x)


def by_rows(rows: int | torch.SymInt, few: Callable[..., Any], many: Callable[..., Any],
            operands: tuple[torch.Tensor, ...]) -> Any:
    """``few(*operands)`` for at most `kernels.SMALL_LINEAR_ROWS` rows, ``many(*operands)`` otherwise.

    Both must return the same tensors (or tuples of them) in shape and dtype; operands are tensors only
    (weights included: the branches close over no parameters, so export lifts nothing behind the
    store's back; nor symbolic sizes: take them from the operands' shapes inside).
    """
    return torch.cond(rows <= kernels.SMALL_LINEAR_ROWS, few, many, operands)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None,
           norm: kernels.Norm | None = None) -> torch.Tensor:
    """``F.linear`` of a decode step's rows [B, K]: the small-linear kernel for a few, cuBLAS for more.

    ``norm`` = (weight, partial sums of squares of x's rows, eps): an RMSNorm of ``x`` first, folded
    into the kernel for a few rows (see `kernels.small_linear`), `layers.rms_norm` for more.
    A packed ``weight`` takes the kernel for any number of rows (`kernel_rows`), an FP8 (``f8r``) one the
    native op where `fp8_folds`, else `packed.fp8_linear` with the norm before it.
    """
    nw, ss, eps = norm if norm is not None else (None, None, 0.0)
    if activation_quantized(weight) and not kernel_rows([weight], x):
        return matmul(rms_norm(x, nw, eps) if norm is not None else x, weight, bias)
    wt, unflatten = flatten([weight])

    def few(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        w, rest = unflatten(rest[:len(wt)])[0], rest[len(wt):]
        y = kernel_linear(x, w, norm=(rest[0], rest[1], eps) if norm is not None else None)[0]
        return y + rest[-1] if bias is not None else y

    def many(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        w, rest = rest[0], rest[1:]
        return F.linear(rms_norm(x, rest[0], eps) if norm is not None else x, w, rest[-1] if bias is not None else None)

    operands = (x, *wt) + ((nw, ss) if norm is not None else ()) + ((bias,) if bias is not None else ())
    if isinstance(weight, Packed):  # (FP8 here too: `fp8_folds`)
        return few(*operands)
    return by_rows(x.shape[0], few, many, operands)


def kernel_rows(weights: Sequence[Weight], x: torch.Tensor) -> bool:
    """True when a decode step of x's rows, any number of them, takes the packed kernels for these weights (no
    cuBLAS branch): when any is packed, and FP8 ones (`fp8_rows`) only where the native op takes them
    (`fp8_folds`). Dequantizing for cuBLAS would
    write and read the weight in bf16 every step; the kernel runs them in 16-row programs, a row
    block's weight tiles shared through L2 (a branch per row count returned partial sums whose
    symbolic strides ``torch.cond`` refuses)."""
    return any(isinstance(w, Packed) for w in weights) and (not fp8_rows(weights) or fp8_folds(x))


def fp8_rows(weights: Sequence[Weight]) -> bool:
    """True when these weights are FP8 (``f8r``): a decode step of any number of rows takes the native packed op
    where `fp8_folds`, else `packed.fp8_linear` (the ops of the many-rows branch); never the small-linear kernel."""
    return any(activation_quantized(w) for w in weights)


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum of squares in fp32 [B, 1]: the one partial sum a norm folded into `linear` needs
    for a row that no small-linear kernel produced (the embedding output)."""
    return x.float().pow(2).sum(-1, keepdim=True)
