"""A decode step's projections: one fused kernel per projection for a few rows, torch ops for more.

At batch 1 a decode step is a chain of matrix-vector products, each reading a weight once. cuBLAS
runs them as split-K GEMMs plus a reduction kernel, and the RMSNorm, SwiGLU and residual adds around
them are kernels of their own; `kernels.small_linear` reads each weight once in one kernel with the
SwiGLU or residual add after it folded in (benchmarks/gemv_cuda.py). It serves up to `kernels.SMALL_LINEAR_ROWS` rows; wider
batches keep cuBLAS and Inductor's fusions. The choice is a ``torch.cond`` on the batch size, which
the exported method evaluates on the host: each batch size's CUDA graph holds only its branch.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import kernels


def fused_decode(x: torch.Tensor, decode: bool) -> bool:
    """Whether a method traced with ``x`` takes the fused path: a decode step on a CUDA device with Triton
    (then the kernel ops are registered here, outside the ``torch.cond`` branches that call them)."""
    if not (decode and x.is_cuda and kernels.available()):
        return False
    kernels.register()
    return True


def by_rows(rows: int | torch.SymInt, few: Callable[..., torch.Tensor], many: Callable[..., torch.Tensor],
            operands: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``few(*operands)`` for at most `kernels.SMALL_LINEAR_ROWS` rows, ``many(*operands)`` otherwise.

    Both must return the same shape and dtype; operands are tensors only (weights included: the
    branches close over no parameters, so export lifts nothing behind the store's back).
    """
    return torch.cond(rows <= kernels.SMALL_LINEAR_ROWS, few, many, operands)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of a decode step's rows [B, K]: the small-linear kernel for a few, cuBLAS for more."""

    def few(x: torch.Tensor, w: torch.Tensor, *b: torch.Tensor) -> torch.Tensor:
        y = kernels.small_linear(x, w)
        return y + b[0] if b else y

    def many(x: torch.Tensor, w: torch.Tensor, *b: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w, *b)

    return by_rows(x.shape[0], few, many, (x, weight) if bias is None else (x, weight, bias))
