"""Batch invariance at the method level: one session's decode call, placed anywhere in any batch.

`decode_placed` runs a bundle's decode method once on pools built here: the session's state row at
pool row ``row`` of a pool of ``pool_rows`` rows, every other row random, and a batch whose rows are
``batch`` (the session's row among them), each neighbour at its own random token and position. It
returns the session's logits and its state row after the call; a batch-invariant decode gives the
same bits for every placement.
"""

from __future__ import annotations

import torch

from onecopy.bundle import parse_dtype


def session_state(engine, seed: int) -> dict[str, torch.Tensor]:
    """A random state row for every state tensor of the bundle (small values: KV, conv, recurrent)."""
    g = torch.Generator().manual_seed(seed)
    return {f: (0.1 * torch.randn(s.shape, generator=g)).to(parse_dtype(s.dtype)).to(engine.device)
            for f, s in engine.manifest.state.items()}


def decode_placed(engine, state: dict[str, torch.Tensor], token: int, position: int, *, pool_rows: int, row: int,
                  batch: list[int], seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The session's (logits, state row after the step) with its row at ``row`` of a ``pool_rows`` pool,
    decoded in one call together with the other rows of ``batch``."""
    assert row in batch and len(set(batch)) == len(batch) and max(batch) < pool_rows
    method = engine.method(engine.role_method("decode"))
    g = torch.Generator().manual_seed(1000 + seed)
    pools = []
    for f in method.spec.state:
        p = (0.1 * torch.randn((pool_rows, *state[f].shape), generator=g)).to(state[f].dtype).to(engine.device)
        p[row] = state[f]
        pools.append(p)
    n = len(batch)
    tokens = torch.randint(0, engine.vocab_size, (n, 1), generator=g)
    positions = torch.randint(0, engine.max_seq_len, (n,), generator=g)
    i = batch.index(row)
    tokens[i, 0], positions[i] = token, position
    dev = engine.device
    logits = method(tokens.to(dev), positions.to(dev), torch.tensor(batch).to(dev), *pools)
    return logits[i].clone(), {f: p[row].clone() for f, p in zip(method.spec.state, pools)}


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
