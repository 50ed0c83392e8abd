"""Paged KV: block tensors shared by every session, a block table per session row, refcounts.

Each paged state FQN is one tensor [blocks + 1, *block shape] carved from one buffer allocated at load
(the last block is scratch: padding rows and table entries past a row's blocks point at it). Row r's
positions [i * BS, (i + 1) * BS) live in block ``table[r, i]``; the compiled methods read the table
(`models.attention.attend_paged`). A block is referenced by every row whose table names it; sessions
that start with the same prompt share its blocks through the `prefix.PrefixIndex`, and a session
about to write into a block someone else can read gets its own copy first (copy on write), so a
session never writes what another can read. Blocks nobody references but the index still publishes
are evicted least recently used when blocks run out. Callers hold the engine's lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..bundle import TensorSpec
from ..errors import SessionCapacityError
from .pool import carve
from .prefix import PrefixIndex


class KVBlocks:
    """``blocks`` KV blocks of ``block_size`` positions for ``rows`` sessions (see the module doc)."""

    def __init__(self, specs: dict[str, TensorSpec], blocks: int, rows: int, width: int, block_size: int,
                 device: torch.device, prefix_cache: bool) -> None:
        self.blocks, self.rows, self.width, self.block_size, self.device = blocks, rows, width, block_size, device
        self.scratch = blocks
        self.block_bytes = sum(s.nbytes for s in specs.values())
        self.buffer, self.tensors = carve(specs, blocks + 1, device)
        self.table = torch.full((rows + 1, width), self.scratch, dtype=torch.long, device=device)
        self.owned: list[list[int]] = [[] for _ in range(rows + 1)]  # each row's blocks, in table order
        self.refs = [0] * blocks
        self._free = list(range(blocks - 1, -1, -1))  # a stack: the lowest block is handed out first
        self.index = PrefixIndex(block_size) if prefix_cache else None
        self.copies = 0  # blocks copied on write

    # -- capacity ----------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.buffer.untyped_storage().nbytes() + self.table.untyped_storage().nbytes()

    @property
    def available(self) -> int:
        """Blocks a session may still take: the free ones and the evictable cached ones."""
        return len(self._free) + (self.index.evictable if self.index is not None else 0)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def cost(self, row: int, start: int, upto: int) -> int:
        """Blocks row ``row`` must take to write positions [start, upto): new ones and copies on write."""
        have = self.owned[row]
        return max(0, self.blocks_for(upto) - len(have)) + sum(
            1 for b in have[start // self.block_size:] if self.refs[b] > 1)

    # -- a row's blocks --------------------------------------------------------------------------------
    def share(self, row: int, blocks: Sequence[int]) -> None:
        """Start empty row ``row`` on ``blocks`` (a cached prefix): each is referenced once more."""
        assert not self.owned[row], "share() starts a row"
        for b in blocks:
            self._reference(b)
        self.owned[row] = list(blocks)
        self._write_table(row, 0)

    def prepare(self, row: int, start: int, upto: int) -> None:
        """Make positions [start, upto) of ``row`` writable: its own copy of any block there that another
        row or the index can read, and new blocks past its last. SessionCapacityError (nothing taken)
        when the blocks are not there."""
        need = self.cost(row, start, upto)
        if need > self.available:
            raise SessionCapacityError(
                f"the KV cache is full: writing positions {start}..{upto - 1} needs {need} more blocks of "
                f"{self.block_size} positions and {self.available} are free or evictable (of {self.blocks}); "
                "wait for other sessions to end, close idle sessions, or load the engine with more memory")
        have, first = self.owned[row], start // self.block_size
        changed, fresh = len(have), []
        for i in range(first, len(have)):
            b = have[i]
            if self.refs[b] > 1:  # copy on write: the others keep the original
                new = self._take()
                for t in self.tensors.values():
                    t[new].copy_(t[b])
                self.refs[b] -= 1
                have[i] = new
                self.copies += 1
                changed = min(changed, i)
            elif self.index is not None and b in self.index:
                self._free.extend(self.index.remove(b))  # ours alone: it stops being a cached prefix
        while len(have) < self.blocks_for(upto):
            fresh.append(self._take())
            have.append(fresh[-1])
        if fresh:  # zeroed, as a row was: what a session holds past its position never depends on who held it before
            idx = torch.tensor(fresh, device=self.device)
            for t in self.tensors.values():  # as bytes: index_fill_ has no float8 kernel
                t.view(torch.uint8).index_fill_(0, idx, 0)
        self._write_table(row, changed)

    def trim(self, row: int, positions: int) -> None:
        """Drop the blocks of ``row`` past its first ``positions`` positions (what a request reserved and
        did not use)."""
        keep = self.blocks_for(positions)
        have = self.owned[row]
        if len(have) > keep:
            for b in have[keep:]:
                self._unreference(b)
            del have[keep:]
            self.table[row, keep:].fill_(self.scratch)

    def release(self, row: int) -> None:
        """Drop every block of ``row`` (its session closed or reset)."""
        self.trim(row, 0)

    def publish(self, row: int, tokens: Sequence[int]) -> None:
        """Offer the full blocks of ``row``, which holds ``tokens`` from position 0, to later prompts."""
        if self.index is not None:
            self.index.publish(self.owned[row], tokens)

    def lookup(self, tokens: Sequence[int], touch: bool = True) -> list[int]:
        """Cached blocks holding the longest block-aligned prefix of ``tokens`` (none without the cache)."""
        return self.index.lookup(tokens, touch) if self.index is not None else []

    # -- contents ------------------------------------------------------------------------------------
    def gather(self, row: int) -> dict[str, torch.Tensor]:
        """The row's logical state per FQN, [H, width * BS, D]-shaped (positions past its blocks zero): a copy."""
        have = self.owned[row]
        out = {}
        for fqn, t in self.tensors.items():
            full = t.new_zeros((self.width, *t.shape[1:]))
            if have:
                full[:len(have)] = t[torch.tensor(have, device=t.device)]
            out[fqn] = full.transpose(0, 1).reshape(t.shape[1], self.width * self.block_size, *t.shape[3:])
        return out

    def scatter(self, row: int, state: dict[str, torch.Tensor], positions: int) -> None:
        """Write the logical state of `gather` into the row's blocks (taken for ``positions`` first)."""
        self.prepare(row, 0, positions)
        self.write(row, state)

    def write(self, row: int, state: dict[str, torch.Tensor]) -> None:
        """Write the logical state of `gather` into the blocks the row holds (as many as it holds)."""
        have = torch.tensor(self.owned[row], device=self.device)
        for fqn, t in self.tensors.items():
            src = state[fqn].to(t.device).reshape(t.shape[1], self.width, self.block_size, *t.shape[3:]).transpose(0, 1)
            if len(have):
                t[have] = src[:len(have)]

    def logical_shape(self, spec: TensorSpec) -> list[int]:
        """The shape `gather` gives for a paged FQN of block shape ``spec.shape``."""
        return [spec.shape[0], self.width * self.block_size, *spec.shape[2:]]

    # -- accounting ---------------------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        """Blocks by kind: shared (referenced by 2+ rows), private (by one), cached (by none, evictable), free."""
        refs = self.refs
        shared = sum(1 for r in refs if r > 1)
        private = sum(1 for r in refs if r == 1)
        cached = self.index.evictable if self.index is not None else 0
        return {"shared": shared, "private": private, "cached": cached, "free": len(self._free),
                "references": sum(refs)}

    def release_memory(self) -> None:
        self.buffer.untyped_storage().resize_(0)
        self.table.untyped_storage().resize_(0)
        self.tensors = {}

    # -- internals -----------------------------------------------------------------------------------
    def _take(self) -> int:
        if not self._free:
            evicted = self.index.evict_lru() if self.index is not None else None
            assert evicted is not None, "callers check `available` first"
            block, freed = evicted
            self._free.extend(freed)
        else:
            block = self._free.pop()
        self.refs[block] = 1
        return block

    def _reference(self, block: int) -> None:
        if self.refs[block] == 0 and self.index is not None:
            self.index.referenced(block)
        self.refs[block] += 1

    def _unreference(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0 and not (self.index is not None and self.index.unreferenced(block)):
            self._free.append(block)

    def _write_table(self, row: int, start: int) -> None:
        have = self.owned[row]
        if start < len(have):
            self.table[row, start:len(have)].copy_(torch.tensor(have[start:], dtype=torch.long), non_blocking=True)
