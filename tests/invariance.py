"""Batch invariance of a deterministic engine's decode step: one session's step, placed anywhere in any batch.

`decode_placed` runs one decode step the way the engine does (its decode method in a `DecodeStep`:
batched for a batch-invariant method, one row per call otherwise) on a pool built here: the
session's state row at row ``row`` of a pool of ``pool_rows`` rows, every other row random, and a
step whose rows are ``batch`` (the session's row among them), each neighbour at its own random token
and position. It returns the session's logits and its state row after the step; a deterministic
engine gives the same bits for every placement.
"""

from __future__ import annotations

import torch

from onecopy.bundle import parse_dtype
from onecopy.runtime.block_tensors import BlockTensors
from onecopy.runtime.pool import StatePool
from onecopy.runtime.step import DecodeStep, default_buckets, runs_one_row_per_call
from onecopy.runtime.workspace import Workspace


def session_state(engine, seed: int) -> dict[str, torch.Tensor]:
    """A random state row for every state tensor of the bundle (small values: KV, conv, recurrent)."""
    g = torch.Generator().manual_seed(seed)
    m = engine.manifest
    shape = {f: engine.runner.blocks.logical_shape(s) for f, s in m.state.items() if s.paged}  # paged KV: its logical row
    return {f: (0.1 * torch.randn(shape.get(f, s.shape), generator=g)).to(parse_dtype(s.dtype)).to(engine.device)
            for f, s in m.state.items()}


def decode_placed(engine, state: dict[str, torch.Tensor], token: int, position: int, *, pool_rows: int, row: int,
                  batch: list[int], seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The session's (logits, state row after the step) with its row at ``row`` of a ``pool_rows`` pool,
    decoded in one call together with the other rows of ``batch``."""
    assert row in batch and len(set(batch)) == len(batch) and max(batch) < pool_rows
    method = engine.method(engine.role_method("decode"))
    g = torch.Generator().manual_seed(1000 + seed)
    m = engine.manifest
    paged = set(m.paged_state)
    pool = StatePool({f: s for f, s in m.state.items() if f not in paged}, pool_rows, engine.device)
    for f, p in pool.tensors.items():
        p.copy_((0.1 * torch.randn(p.shape, generator=g)).to(p.dtype))
        p[row] = state[f]
    pools = [pool.tensors[f] for f in method.spec.state if f not in paged]
    blocks, order = None, None
    if paged:  # every row's blocks at shuffled places, the session's among them
        width, bs = m.table_width, m.kv_block_size
        blocks = BlockTensors({f: m.state[f] for f in paged}, pool_rows * width, pool_rows, width, bs, engine.device)
        order = torch.randperm(pool_rows * width, generator=g).view(pool_rows, width)
        blocks.table[:pool_rows] = order.to(engine.device)
        for t in blocks.tensors.values():
            t.copy_((0.1 * torch.randn(t.shape, generator=g)).to(t.dtype))
        blocks.write(order[row].tolist(), {f: state[f] for f in paged})
        pools = [blocks.table, *[blocks.tensors[f] for f in method.spec.state]]
    step = DecodeStep(method, pool, pools, Workspace(), buckets=default_buckets(pool_rows),
                      one_row_per_call=runs_one_row_per_call(method.spec, engine.deterministic))
    n = len(batch)
    tokens = torch.randint(0, engine.vocab_size, (n,), generator=g)
    positions = torch.randint(0, engine.max_seq_len, (n,), generator=g)
    i = batch.index(row)
    tokens[i], positions[i] = token, position
    logits = step(batch, positions.tolist(), tokens.to(engine.device))
    after = {f: p[row].clone() for f, p in pool.tensors.items()}
    if blocks is not None:
        after.update(blocks.gather(order[row].tolist()))
    return logits[i].clone(), after


# (pool rows, the session's row, the batch's rows in order): alone at row 0 of 3 first, then at row 5
# of 8 among neighbours at several batch indices and sizes, then past 16 rows (wider CPU and GPU blocking).
PLACEMENTS = [
    (3, 0, [0]),
    (8, 5, [5]),
    (8, 5, [2, 5]),
    (8, 5, [1, 4, 2, 0, 6, 5, 7, 3]),
    (8, 5, [0, 1, 2, 3, 4, 5]),
    (24, 17, list(range(23, -1, -1))),
    (70, 5, list(range(70))),
]


def assert_invariant(engine, token: int = 7, position: int = 9, seed: int = 1) -> None:
    """The session's logits and state row are bit-identical in every placement of `PLACEMENTS`."""
    state = session_state(engine, seed)
    ref_logits, ref_state = decode_placed(engine, state, token, position, pool_rows=3, row=0, batch=[0])
    assert torch.isfinite(ref_logits).all()
    for pool_rows, row, batch in PLACEMENTS[1:]:
        logits, after = decode_placed(engine, state, token, position, pool_rows=pool_rows, row=row, batch=batch)
        where = f"row {row} of a {pool_rows}-row pool at batch index {batch.index(row)} of {len(batch)}"
        assert torch.equal(logits, ref_logits), f"logits differ at {where}: max {(logits - ref_logits).abs().max()}"
        for f, t in after.items():
            assert torch.equal(t, ref_state[f]), f"state {f} differs at {where}"
