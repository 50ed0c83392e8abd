"""What every model family gives the exporter: its methods as modules with example inputs."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..bundle import InputSpec, table_width
from . import invariant
from .invariant import invariant_method
from .packed import has_activation_quantized

MAX_BATCH = 1024  # most sessions one decode call takes
MAX_POOL_ROWS = 1 << 16  # most state-pool rows a method accepts
# Example sizes for export: all different, so no two dynamic dims are unified by accident.
EXAMPLE_BATCH, EXAMPLE_POOL_ROWS = 2, 3


@dataclass
class MethodDef:
    """What the exporter needs for one method: a module whose forward is the method, and inputs.

    ``args`` are the example inputs (the user inputs, then rows, then one pool per ``state`` FQN);
    ``inputs`` describes the user inputs only.
    """

    module: nn.Module
    args: tuple[torch.Tensor, ...]
    dynamic_shapes: tuple
    inputs: list[InputSpec]
    role: str
    state: list[str] = field(default_factory=list)
    batch_invariant: bool = False  # each row's results independent of the batch (see `invariant`)
    paged: bool = False  # takes the KV block table [P, NBMAX] after rows; its pools are blocks


class PooledModel(nn.Module):
    """A token model over the state pool: ``decode``/``prefill`` take rows and pools; ``forward`` is eager.

    Subclasses give ``state_specs``, ``decode(tokens, input_pos, rows, *pools)`` and ``prefill(*
    prefill_inputs(tokens, input_pos), rows, *pools)``.
    """

    _eager_state: list[torch.Tensor] | None = None  # a one-session pool for eager calls (not a buffer)
    kv_block: int | None = None  # paged KV: positions per block (set before export); None: one row per session

    def split_table(self, pools: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """(the block table, the pools) of a paged method's trailing inputs; (None, pools) otherwise."""
        return (pools[0], pools[1:]) if self.kv_block else (None, pools)

    def prefill_inputs(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The prefill inputs before ``rows`` for a chunk of one session (override to add some)."""
        return tokens, input_pos

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Eager: feed ``tokens[1, T]`` at ``input_pos[T]`` to the module's own single session."""
        if self._eager_state is None:
            n = table_width(self.max_seq_len, self.kv_block) if self.kv_block else 1  # paged: one session's blocks
            self._eager_state = [torch.zeros(n, *shape, dtype=dtype, device=tokens.device)
                                 for shape, dtype in self.state_specs().values()]
            if self.kv_block:
                self._eager_state.insert(0, torch.arange(n, device=tokens.device)[None])
        row = torch.zeros(1, dtype=torch.long, device=tokens.device)
        if tokens.shape[1] == 1:
            return self.decode(tokens, input_pos, row, *self._eager_state)
        return self.prefill(*self.prefill_inputs(tokens, input_pos), row, *self._eager_state)


def as_method(module: nn.Module, fn: Callable[..., Any]) -> nn.Module:
    """A shallow view of ``module`` whose forward is ``fn``: same parameters, same FQNs."""
    view = copy.copy(module)
    view.__class__ = type(f"{type(module).__name__}_{fn.__name__}", (type(module),), {"forward": fn})
    return view


def example_pools(specs: dict[str, tuple[list[int], torch.dtype]], fqns: list[str], device: str) -> tuple:
    """Example pool tensors [EXAMPLE_POOL_ROWS, *shape] and their dynamic leading dim."""
    rows = torch.export.Dim("pool_rows", min=2, max=MAX_POOL_ROWS)
    pools = tuple(torch.zeros(EXAMPLE_POOL_ROWS, *specs[f][0], dtype=specs[f][1], device=device) for f in fqns)
    return pools, tuple({0: rows} for _ in fqns)


def example_table(rows: int, width: int, device: str) -> tuple[tuple, tuple, int]:
    """An example block table [rows, width] (row r's blocks are r*width ...), its dynamic dims, and how
    many blocks the example pools need."""
    table = torch.arange(rows * width, dtype=torch.long, device=device).view(rows, width)
    return (table,), ({0: torch.export.Dim("pool_rows", min=2, max=MAX_POOL_ROWS)},), rows * width + 1


def pooled_methods(specs: dict[str, tuple[list[int], torch.dtype]], max_seq_len: int, device: str,
                   methods: dict[str, tuple[nn.Module, str]], vocab: list[int],
                   prefill_context: bool = False, kv_block: int | None = None,
                   batched_prefill: bool = False) -> dict[str, MethodDef]:
    """MethodDefs for token methods of the two standard roles, every state pool passed to each.

    A decode method ``<name>`` (the fastest: the BLAS GEMM on CPU, cuBLAS past a few rows on CUDA); on
    CUDA also ``<name>_invariant`` (batch-invariant, `invariant`; for deterministic engines. On CPU a
    deterministic engine runs ``<name>`` one row per call instead: faster there, see `runtime.step`).
    decode(tokens[B, 1], input_pos[B], rows[B], *pools); prefill(tokens[1, T], input_pos[T], rows[1], *pools),
    or with ``prefill_context`` prefill(tokens[1, T], input_pos[T], context[L], rows[1], *pools) where
    ``context`` is arange(L), L = the chunk's last position + 1: its length, a dynamic dim, lets the
    chunk attend to the filled prefix only (the runtime passes a view, no copy).
    ``kv_block``: paged KV: the block table [P, NBMAX] follows rows, and the pools' leading dim counts
    blocks of ``kv_block`` positions. ``batched_prefill`` (with ``prefill_context``): the prefill takes N
    equal-length chunks of N sessions at once, prefill(tokens[N, T], input_pos[N, T], context[L], rows[N],
    *pools) -> logits[N, vocab], L the longest chunk's last position + 1 (one call for many prompts).
    """
    fqns = list(specs)
    pools, pool_dims = example_pools(specs, fqns, device)
    table, table_dims = (), ()
    if kv_block:
        table, table_dims, n_blocks = example_table(EXAMPLE_POOL_ROWS, table_width(max_seq_len, kv_block), device)
        blocks = torch.export.Dim("kv_blocks", min=2, max=1 << 24)
        pools = tuple(torch.zeros(n_blocks, *specs[f][0], dtype=specs[f][1], device=device) for f in fqns)
        pool_dims = tuple({0: blocks} for _ in fqns)
    long = dict(dtype=torch.long, device=device)
    positions = [0, max_seq_len]
    out: dict[str, MethodDef] = {}
    for name, (module, role) in methods.items():
        if role == "decode":
            b = torch.export.Dim("batch", min=1, max=MAX_BATCH)
            dyn = {"min": 1, "max": MAX_BATCH}
            args = (torch.zeros(EXAMPLE_BATCH, 1, **long), torch.zeros(EXAMPLE_BATCH, **long),
                    torch.tensor([0, 1], **long))
            shapes = ({0: b}, {0: b}, {0: b})
            inputs = [InputSpec("tokens", "int64", [dyn, 1], vocab), InputSpec("input_pos", "int64", [dyn], positions)]
        elif role == "prefill":
            if max_seq_len < 2:
                continue  # nothing to chunk: prompts go through decode
            t = torch.export.Dim("seq_len", min=1, max=max_seq_len)
            dyn = {"min": 1, "max": max_seq_len}
            args = (torch.zeros(1, 2, **long), torch.arange(2, **long), torch.zeros(1, **long))
            shapes = ({1: t}, {0: t}, {})
            inputs = [InputSpec("tokens", "int64", [1, dyn], vocab), InputSpec("input_pos", "int64", [dyn], positions)]
            if batched_prefill:
                n = torch.export.Dim("chunks", min=1, max=MAX_BATCH)
                dyn_n = {"min": 1, "max": MAX_BATCH}
                ctx = torch.export.Dim("context", min=1, max=max_seq_len)
                # example: two 3-token chunks at positions 1..3 and 2..4 (a 5-long context), rows 0 and 1
                args = (torch.zeros(EXAMPLE_BATCH, 3, **long), torch.arange(3, **long) + torch.tensor([[1], [2]], **long),
                        torch.arange(5, **long), torch.arange(EXAMPLE_BATCH, **long))
                shapes = ({0: n, 1: t}, {0: n, 1: t}, {0: ctx}, {0: n})
                inputs = [InputSpec("tokens", "int64", [dyn_n, dyn], vocab),
                          InputSpec("input_pos", "int64", [dyn_n, dyn], positions),
                          InputSpec("context", "int64", [dyn], positions)]
            elif prefill_context:
                ctx = torch.export.Dim("context", min=1, max=max_seq_len)
                # example: the chunk at positions 2, 3 of a 4-long prefix
                args = (args[0], torch.arange(2, 4, **long), torch.arange(4, **long), args[2])
                shapes = (shapes[0], shapes[1], {0: ctx}, {})
                inputs.append(InputSpec("context", "int64", [dyn], positions))
        else:
            raise ValueError(f"pooled_methods makes decode and prefill methods, not {role!r}")
        # *pools (the table first when paged): one entry of dynamic shapes
        full, dims = args + table + pools, shapes + (table_dims + pool_dims,)
        out[name] = MethodDef(module, full, dims, inputs, role, fqns, paged=bool(kv_block))
        # An FP8 GEMM (cuBLAS / CUTLASS tiles picked per batch size) has no batch-invariant form.
        if role == "decode" and invariant.available(device) and not has_activation_quantized(module):
            out[f"{name}_invariant"] = MethodDef(invariant_method(module), full, dims, inputs, role, fqns,
                                                 batch_invariant=True, paged=bool(kv_block))
    return out
