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
from ..sampling import to_device
from .plan import ClearTable, CopyBlock, SetTable, StateOp, TierOp, ZeroBlocks
from .pool import carve
from .tier_store import TierStore


class BlockTensors:
    """``blocks`` KV blocks of ``block_size`` positions and a table ``width`` blocks wide for ``rows`` rows."""

    def __init__(self, specs: dict[str, TensorSpec], blocks: int, rows: int, width: int, block_size: int,
                 device: torch.device) -> None:
        self.blocks, self.rows, self.width, self.block_size, self.device = blocks, rows, width, block_size, device
        self.scratch = blocks
        self.block_bytes = sum(s.nbytes for s in specs.values())
        self.buffer, self.tensors = carve(specs, blocks + 1, device)
        self.table = torch.full((rows + 1, width), self.scratch, dtype=torch.long, device=device)
        self.tiers: TierStore | None = None  # host and disk tiers of evicted prefixes (`kv_tiers`), if on

    @property
    def nbytes(self) -> int:
        return self.buffer.untyped_storage().nbytes() + self.table.untyped_storage().nbytes()

    def apply(self, ops: Sequence[StateOp]) -> None:
        """Carry out the KV cache manager's decisions, in effect in order, with a few launches for a step's
        many: every block zeroed between two copies in one fill per tensor, every table entry set in one
        write (a block's content ops never read the table, so table writes move freely among them; zeroing
        only moves within a run without copies, whose sources may be blocks zeroed after them), each run of
        tier operations (saves to and loads from host and disk) moved together by the tiers' store."""
        zero: list[int] = []
        entries: dict[tuple[int, int], int] = {}  # (row, index) -> block: the last decision wins
        tier: list[StateOp] = []  # a run of tier operations, not yet carried out
        for op in ops:
            if isinstance(op, TierOp):
                if not tier:
                    self._zero(zero)  # the tiers read and write block contents: in order with the zeroing
                    zero = []
                tier.append(op)
                continue
            if tier:
                self._tier(tier)
                tier = []
            if isinstance(op, ZeroBlocks):
                zero.extend(op.blocks)
            elif isinstance(op, SetTable):
                entries.update(((op.row, op.start + i), b) for i, b in enumerate(op.blocks))
            elif isinstance(op, CopyBlock):  # copy on write: the others keep the original
                self._zero(zero)
                zero = []
                for t in self.tensors.values():
                    t[op.dst].copy_(t[op.src])
            elif isinstance(op, ClearTable):
                self._set(entries)
                entries = {}
                self.table[op.row, op.start:].fill_(self.scratch)
            else:
                raise TypeError(f"not a KV block operation: {op!r}")
        if tier:
            self._tier(tier)
        self._zero(zero)
        self._set(entries)

    def _tier(self, ops: list[StateOp]) -> None:
        assert self.tiers is not None, "tier operations are queued only where the tiers are on"
        self.tiers.apply(ops, self.tensors)

    def _zero(self, blocks: list[int]) -> None:
        if blocks:  # as bytes: index_fill_ has no float8 kernel
            idx = to_device(torch.tensor(blocks, dtype=torch.long), self.device)
            for t in self.tensors.values():
                t.view(torch.uint8).index_fill_(0, idx, 0)

    def _set(self, entries: dict[tuple[int, int], int]) -> None:
        if entries:
            idx = to_device(torch.tensor([[r for r, _ in entries], [i for _, i in entries], list(entries.values())],
                                         dtype=torch.long), self.device)
            self.table[idx[0], idx[1]] = idx[2]

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
        if self.tiers is not None:
            self.tiers.close()
        self.buffer.untyped_storage().resize_(0)
        self.table.untyped_storage().resize_(0)
        self.tensors = {}
