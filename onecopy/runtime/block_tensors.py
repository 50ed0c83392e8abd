"""Paged KV on the device: the block tensors every row shares and the block table the methods read.

Each paged state FQN is one tensor [blocks + 1, *block shape] carved from one buffer allocated at load
(the last block is scratch: padding rows and table entries past a row's blocks point at it). Row r's
positions [i * BS, (i + 1) * BS) live in block ``table[r, i]`` (`models.attention.attend_paged`).
Which row holds which block is the `kv_manager.KVCacheManager`'s decision (host only); this module
applies its state operations and reads or writes a row's blocks for snapshots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..bundle import TensorSpec
from .plan import ClearTable, CopyBlock, SetTable, StateOp, ZeroBlocks
from .pool import carve


class BlockTensors:
    """``blocks`` KV blocks of ``block_size`` positions and a table ``width`` blocks wide for ``rows`` rows."""

    def __init__(self, specs: dict[str, TensorSpec], blocks: int, rows: int, width: int, block_size: int,
                 device: torch.device) -> None:
        self.blocks, self.rows, self.width, self.block_size, self.device = blocks, rows, width, block_size, device
        self.scratch = blocks
        self.block_bytes = sum(s.nbytes for s in specs.values())
        self.buffer, self.tensors = carve(specs, blocks + 1, device)
        self.table = torch.full((rows + 1, width), self.scratch, dtype=torch.long, device=device)

    @property
    def nbytes(self) -> int:
        return self.buffer.untyped_storage().nbytes() + self.table.untyped_storage().nbytes()

    def apply(self, op: StateOp) -> None:
        """Carry out one of the KV cache manager's decisions."""
        if isinstance(op, CopyBlock):  # copy on write: the others keep the original
            for t in self.tensors.values():
                t[op.dst].copy_(t[op.src])
        elif isinstance(op, ZeroBlocks):  # as bytes: index_fill_ has no float8 kernel
            idx = torch.tensor(op.blocks, device=self.device)
            for t in self.tensors.values():
                t.view(torch.uint8).index_fill_(0, idx, 0)
        elif isinstance(op, SetTable):
            self.table[op.row, op.start:op.start + len(op.blocks)].copy_(
                torch.tensor(op.blocks, dtype=torch.long), non_blocking=True)
        elif isinstance(op, ClearTable):
            self.table[op.row, op.start:].fill_(self.scratch)
        else:
            raise TypeError(f"not a KV block operation: {op!r}")

    def gather(self, blocks: Sequence[int]) -> dict[str, torch.Tensor]:
        """A row's logical state per FQN from its ``blocks``, [H, width * BS, D]-shaped (positions past its
        blocks zero): a copy."""
        out = {}
        for fqn, t in self.tensors.items():
            full = t.new_zeros((self.width, *t.shape[1:]))
            if blocks:
                full[:len(blocks)] = t[torch.tensor(list(blocks), device=t.device)]
            out[fqn] = full.transpose(0, 1).reshape(t.shape[1], self.width * self.block_size, *t.shape[3:])
        return out

    def write(self, blocks: Sequence[int], state: dict[str, torch.Tensor]) -> None:
        """Write the logical state of `gather` into ``blocks`` (as many as there are)."""
        have = torch.tensor(list(blocks), device=self.device)
        for fqn, t in self.tensors.items():
            src = state[fqn].to(t.device).reshape(t.shape[1], self.width, self.block_size, *t.shape[3:]).transpose(0, 1)
            if len(have):
                t[have] = src[:len(have)]

    def logical_shape(self, spec: TensorSpec) -> list[int]:
        """The shape `gather` gives for a paged FQN of block shape ``spec.shape``."""
        return [spec.shape[0], self.width * self.block_size, *spec.shape[2:]]

    def release_memory(self) -> None:
        self.buffer.untyped_storage().resize_(0)
        self.table.untyped_storage().resize_(0)
        self.tensors = {}
