"""A step's KV block operations, applied together (one fill for the zeroed blocks between copies, one write for
the table entries), leave the blocks and the table exactly as applying them one by one in order does."""

from __future__ import annotations

import random

import torch

from onecopy.bundle import TensorSpec
from onecopy.runtime.block_tensors import BlockTensors
from onecopy.runtime.plan import ClearTable, CopyBlock, SetTable, ZeroBlocks

SPECS = {"k": TensorSpec([2, 4, 3], "float32"), "k_scale": TensorSpec([2, 4], "float32"),
         "v": TensorSpec([2, 4, 3], "int8")}
BLOCKS, ROWS, WIDTH = 12, 4, 5


def one_by_one(bt: BlockTensors, ops) -> None:
    """The operations' meaning, one at a time (the reference)."""
    for op in ops:
        if isinstance(op, CopyBlock):
            for t in bt.tensors.values():
                t[op.dst] = t[op.src]
        elif isinstance(op, ZeroBlocks):
            for t in bt.tensors.values():
                t[list(op.blocks)] = 0
        elif isinstance(op, SetTable):
            bt.table[op.row, op.start:op.start + len(op.blocks)] = torch.tensor(op.blocks)
        else:
            bt.table[op.row, op.start:] = bt.scratch


def filled() -> BlockTensors:
    bt = BlockTensors(SPECS, BLOCKS, ROWS, WIDTH, 4, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for t in bt.tensors.values():
        t.copy_(torch.randint(1, 100, t.shape, generator=g).to(t.dtype))
    return bt


def random_ops(rng: random.Random, n: int) -> list:
    ops = []
    for _ in range(n):
        kind = rng.randrange(4)
        if kind == 0:
            ops.append(CopyBlock(rng.randrange(BLOCKS), rng.randrange(BLOCKS)))
        elif kind == 1:
            ops.append(ZeroBlocks(tuple(rng.sample(range(BLOCKS), rng.randint(1, 3)))))
        elif kind == 2:
            start = rng.randrange(WIDTH)
            ops.append(SetTable(rng.randrange(ROWS), start,
                                tuple(rng.randrange(BLOCKS) for _ in range(rng.randint(1, WIDTH - start)))))
        else:
            ops.append(ClearTable(rng.randrange(ROWS), rng.randrange(WIDTH)))
    return ops


def test_operations_applied_together_equal_them_applied_in_order():
    """300 random sequences mixing copies (whose sources are zeroed later or earlier), zeroing, table writes
    (entries written twice, the last one winning) and clears: the same blocks and table, bit for bit."""
    rng = random.Random(0)
    for _ in range(300):
        ops = random_ops(rng, rng.randint(1, 12))
        got, want = filled(), filled()
        got.apply(ops)
        one_by_one(want, ops)
        assert torch.equal(got.table, want.table), ops
        for fqn, t in want.tensors.items():
            assert torch.equal(got.tensors[fqn], t), (fqn, ops)


def test_a_steps_growth_is_one_fill_per_tensor_and_one_table_write(monkeypatch):
    """Sixty rows each taking a fresh block (what a decode step at many rows decides): one zero fill per block
    tensor and one table write, not one per row."""
    bt = BlockTensors(SPECS, 64, 64, WIDTH, 4, torch.device("cpu"))
    ops = [op for r in range(60) for op in (ZeroBlocks((r,)), SetTable(r, 1, (r,)))]
    fills = []
    index_fill_ = torch.Tensor.index_fill_
    monkeypatch.setattr(torch.Tensor, "index_fill_", lambda t, *a: fills.append(1) or index_fill_(t, *a))
    writes = []
    set_entries = bt._set
    monkeypatch.setattr(bt, "_set", lambda entries: writes.append(len(entries)) or set_entries(entries))
    bt.apply(ops)
    assert len(fills) == len(SPECS) and writes == [60]
    assert bt.table[:60, 1].tolist() == list(range(60))
