"""Batch-invariant decode on CUDA: a row's arithmetic never depends on the batch it runs in.

A decode step's rows are sessions. For a session's logits, tokens and state to be the same whoever
shares its step (and wherever its row sits), every reduction of the step must take each row in an
order fixed by that row alone. Norms, RoPE and the attention kernels already do (attention splits a
row by its own length); linear layers do not: cuBLAS picks its kernel (tiles, split-K) by M. A decode
method traced under `BatchInvariant` gets `kernels.small_linear` for every linear layer, with one
BLOCK_N and BLOCK_K for every batch size (each row's K order fixed, no split-K): 16 rows per program
up to 16 rows, 64 past that (a row gets the same bits from either tile: tests/gpu).

CPU bundles have no such method: there a deterministic engine runs the BLAS decode one row per call
(`runtime.step`), invariant by construction and faster than any batched invariant reduction we
built (an Inductor mul + sum per linear ran the SmolLM2 decode on one thread, ~12x slower in an ad
hoc timing: README).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from .. import kernels
from .packed import Packed, Weight, flatten, kernel_linear


def available(device: str | torch.device) -> bool:
    """True when a batch-invariant decode can be compiled for ``device`` (CUDA with Triton)."""
    return torch.device(device).type == "cuda" and kernels.available()


def linear_rows(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every output row depends on its input row alone (see the module docstring);
    a packed ``weight`` is read packed."""
    if not (x.is_cuda and kernels.available()):
        raise RuntimeError("the batch-invariant linear is a CUDA kernel (Triton); on CPU run the decode one row per call")
    rows = x.reshape(-1, x.shape[-1])
    flat, unflatten = flatten([weight])

    def few(block_m: int):
        return lambda r, *w: kernel_linear(r, unflatten(w)[0], block_m=block_m, invariant=True)[0]

    if isinstance(weight, Packed):  # 16-row programs at every batch size: a packed tile dequantized for a
        # 64-row program gave a row other bits than for a 16-row one (H100, tests/gpu/test_packed_cuda.py)
        y = few(kernels.SMALL_LINEAR_ROWS)(rows, *flat)
    else:
        y = torch.cond(rows.shape[0] <= kernels.SMALL_LINEAR_ROWS, few(kernels.SMALL_LINEAR_ROWS),
                       few(kernels.INVARIANT_ROWS), (rows, *flat))
    y = y.reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class BatchInvariant(TorchFunctionMode):
    """While active (tracing a decode method), ``F.linear`` (every ``nn.Linear``) is `linear_rows`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear_rows(*args, **kwargs)
        return func(*args, **kwargs)


def active() -> bool:
    """True while a method is being traced under `BatchInvariant`."""
    return any(isinstance(m, BatchInvariant) for m in _get_current_function_mode_stack())


def invariant_method(module: nn.Module) -> nn.Module:
    """A shallow view of ``module`` (same parameters, same FQNs) whose forward runs under `BatchInvariant`."""
    forward = type(module).forward

    @functools.wraps(forward)  # export reads the inputs' names from the signature
    def invariant_forward(self, *args: torch.Tensor) -> torch.Tensor:
        with BatchInvariant():
            return forward(self, *args)

    view = copy.copy(module)
    view.__class__ = type(f"{type(module).__name__}_invariant", (type(module),), {"forward": invariant_forward})
    return view
