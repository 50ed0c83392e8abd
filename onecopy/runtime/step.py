"""The batched decode step: one call of the decode method for any set of sessions' rows.

The batch is the sessions in the step, padded to the next bucket (always with CUDA graphs, one per
bucket; eagerly only when the engine was given ``decode_buckets``) or run at its exact size.
Padding entries point at the scratch row: they can never write a live session.
Which decode method runs decides what a session's numbers may depend on: the batch-invariant one (a
deterministic engine's) gives each row the same bits whatever the batch
(`models.invariant`), so no step needs padding to a fixed size for that.
"""

from __future__ import annotations

import bisect

import torch

from ..sampling import to_device
from .graphs import DecodeGraphs
from .method import Method
from .pool import StatePool
from .workspace import Workspace


def default_buckets(rows: int) -> list[int]:
    """1, 2, 4, ... up to the pool size, and the pool size itself."""
    out, b = [], 1
    while b < rows:
        out.append(b)
        b *= 2
    return out + [rows]


class DecodeStep:
    """Runs decode for (row, token, position) entries; the static inputs live in the workspace."""

    def __init__(self, method: Method, pool: StatePool, workspace: Workspace, *, buckets: list[int],
                 pad: bool = False) -> None:
        self.method, self.pool, self.pad = method, pool, pad
        self.device = pool.device
        self.buckets = sorted(set(buckets))
        width = max(self.buckets)
        self.tokens = workspace.get("decode.tokens", (width, 1), torch.long, self.device, zero=True)
        self.positions = workspace.get("decode.input_pos", (width,), torch.long, self.device, zero=True)
        self.rows = workspace.get("decode.rows", (width,), torch.long, self.device)
        self.rows.fill_(pool.scratch)
        self.pools = [pool.tensors[f] for f in method.spec.state]
        self.graphs: DecodeGraphs | None = None
        # Each row's next input token, left on the device by sampling (or set from a prompt).
        self.last_token = torch.zeros(pool.rows + 1, dtype=torch.long, device=self.device)

    def inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        """What the decode method of ``batch`` rows reads: static input views and the pools."""
        return (self.tokens[:batch], self.positions[:batch], self.rows[:batch], *self.pools)

    def batch_size(self, n: int) -> int:
        """The batch a step of ``n`` sessions runs at."""
        if self.graphs is not None or self.pad:
            return self.buckets[bisect.bisect_left(self.buckets, n)]
        return n

    def __call__(self, rows: list[int], positions: list[int], tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token for each of ``rows`` at ``positions``; logits [n, vocab].

        ``tokens`` (int64 [n] on the device) default to each row's `last_token`. With CUDA graphs
        the result may be a view of a graph's static output, valid until the next step.
        """
        n, b = len(rows), self.batch_size(len(rows))
        rows_pos = to_device(torch.tensor([rows, positions], dtype=torch.long), self.device)
        if tokens is None:
            tokens = self.last_token.index_select(0, rows_pos[0])
        self.rows[:n].copy_(rows_pos[0])
        self.positions[:n].copy_(rows_pos[1])
        self.tokens[:n, 0].copy_(tokens)
        if b > n:
            self.rows[n:b].fill_(self.pool.scratch)
            self.positions[n:b].zero_()
            self.tokens[n:b].zero_()
        if self.graphs is not None:
            out = self.graphs.replay(b)
        else:
            with torch.inference_mode():
                out = self.method(*self.inputs(b))
        return out[:n]
