"""The batched decode step: one call of the decode method for any set of sessions' rows.

The batch is the sessions in the step, padded to the next bucket (always with CUDA graphs, one per
bucket; eagerly only when the engine was given ``decode_buckets``) or run at its exact size.
Padding entries point at the scratch row: they can never write a live session.
What a session's numbers may depend on is decided here. A deterministic engine needs each row's
bits to be the same whatever the batch: with a batch-invariant decode (CUDA, `models.invariant`)
a step runs batched; with any other (the BLAS decode of a CPU bundle, or an older CUDA bundle) it
runs one row per call, each call a batch of one that reads only that row: invariant by construction.
It gives up batching: on 2 CPU cores SmolLM2 generates ~11.5 tok/s this way at 1, 4 or 8 sessions,
against 11.6/27/33 tok/s batched (benchmarks/results/batch_invariance_smollm2_cpu.json). Nothing is
padded to the pool size.
"""

from __future__ import annotations

import bisect

import torch

from ..bundle import MethodSpec
from ..sampling import to_device
from .graphs import DecodeGraphs
from .method import Method
from .pool import StatePool
from .workspace import Workspace


def runs_one_row_per_call(spec: MethodSpec, deterministic: bool) -> bool:
    """Whether a deterministic engine must run this decode one row per call (it is not batch-invariant)."""
    return deterministic and not spec.batch_invariant


def default_buckets(rows: int) -> list[int]:
    """Batch sizes with a decode graph: 1, 2, 4, ... 128, then every 32 rows up to 512 and every 64 past it, and
    the pool size itself. Below ~128 rows a step reads its weights whatever the batch (padding is nearly
    free); past that its GEMMs are compute-bound and a padded row costs what a real one does (a 1000/1000
    throughput run decodes ~340 rows: padded to 512 with powers of two, to 352 here). The graphs share one
    output (`graphs.DecodeGraphs`), so a bucket costs its capture (~0.3 s), not memory."""
    out, b = [], 1
    while b < rows:
        out.append(b)
        b += b if b < 128 else (1 << (b.bit_length() - 1)) // (4 if b < 256 else 8)
    return out + [rows]


class DecodeStep:
    """Runs decode for (row, token, position) entries; the static inputs live in the workspace."""

    def __init__(self, method: Method, pool: StatePool, pools: list[torch.Tensor], workspace: Workspace, *,
                 buckets: list[int], pad: bool = False, one_row_per_call: bool = False) -> None:
        self.method, self.pool, self.pad, self.one_row_per_call = method, pool, pad, one_row_per_call
        self.device = pool.device
        self.buckets = [1] if one_row_per_call else sorted(set(buckets))
        width = max(self.buckets)
        self.tokens = workspace.get("decode.tokens", (width, 1), torch.long, self.device, zero=True)
        self.positions = workspace.get("decode.input_pos", (width,), torch.long, self.device, zero=True)
        self.rows = workspace.get("decode.rows", (width,), torch.long, self.device)
        self.rows.fill_(pool.scratch)
        self.pools = pools  # what the method takes after rows (the block table first when paged)
        self.graphs: DecodeGraphs | None = None
        # Each row's next input token, left on the device by sampling (or set from a prompt).
        self.last_token = torch.zeros(pool.rows + 1, dtype=torch.long, device=self.device)

    def inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        """What the decode method of ``batch`` rows reads: static input views and the pools."""
        return (self.tokens[:batch], self.positions[:batch], self.rows[:batch], *self.pools)

    def batch_size(self, n: int) -> int:
        """The batch a call of a step of ``n`` sessions runs at."""
        if self.one_row_per_call:
            return 1
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
        if self.one_row_per_call:
            return torch.cat([self._call(1, rows_pos[:, i:i + 1], tokens[i:i + 1]).clone() for i in range(n)])
        return self._call(b, rows_pos, tokens)[:n]

    def _call(self, b: int, rows_pos: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One call of the method at batch ``b`` for the entries given, the rest padded with the scratch row."""
        n = rows_pos.shape[1]
        self.rows[:n].copy_(rows_pos[0])
        self.positions[:n].copy_(rows_pos[1])
        self.tokens[:n, 0].copy_(tokens)
        if b > n:
            self.rows[n:b].fill_(self.pool.scratch)
            self.positions[n:b].zero_()
            self.tokens[n:b].zero_()
        if self.graphs is not None:
            return self.graphs.replay(b)
        with torch.inference_mode():
            return self.method(*self.inputs(b))
