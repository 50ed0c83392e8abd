"""The prefix index: which KV blocks hold which prompt prefixes, so a new request reuses them.

A tree over token blocks, as vLLM's automatic prefix caching and SGLang's RadixAttention keep one: a
full block of ``block_size`` tokens is published under (its parent block, its tokens), so a lookup
walks a prompt block by block and stops at the first block nobody holds. The key names the parent
block itself, not a hash of the prefix: two prefixes can never collide. When a block leaves the index
(evicted or overwritten), every block published under it leaves too: a recycled block id must never
lead a lookup to a child that was computed after other tokens.
Blocks no session references stay published and evictable, least recently used first. No tensors
here: `blocks.KVBlocks` owns the memory and asks this index what it may reuse or evict.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

_ROOT = -1  # the parent of a prompt's first block


class PrefixIndex:
    """Published blocks by (parent block, tokens), their children, and the evictable ones in LRU order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._children: dict[int, set[int]] = collections.defaultdict(set)
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # published, unreferenced
        self.hits = 0  # lookups that found at least one block
        self.hit_tokens = 0  # tokens those lookups found

    def __contains__(self, block: int) -> bool:
        return block in self._key_of

    @property
    def evictable(self) -> int:
        return len(self._lru)

    def lookup(self, tokens: Sequence[int], touch: bool = True) -> list[int]:
        """The published blocks holding the longest block-aligned prefix of ``tokens``, in order.
        ``touch`` marks them as just used (an admission, not a look for capacity)."""
        out, parent, bs = [], _ROOT, self.block_size
        for i in range(len(tokens) // bs):
            block = self._by_key.get((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if block is None:
                break
            out.append(block)
            parent = block
        if touch:
            for b in out:
                if b in self._lru:
                    self._lru.move_to_end(b)
            if out:
                self.hits += 1
                self.hit_tokens += len(out) * bs
        return out

    def publish(self, blocks: Sequence[int], tokens: Sequence[int]) -> None:
        """Publish the full blocks of a session that holds ``tokens`` in ``blocks`` (its table, in order).
        A block already published stays as it is; a prefix another block already holds is left private
        (its first holder keeps serving it)."""
        parent, bs = _ROOT, self.block_size
        for i in range(min(len(tokens) // bs, len(blocks))):
            block, key = blocks[i], (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            if self._key_of.get(block) != key:
                if block in self._key_of or key in self._by_key:
                    return  # another prefix lives here, or this one lives elsewhere: the chain stops
                self._by_key[key] = block
                self._key_of[block] = key
                if parent != _ROOT:
                    self._children[parent].add(block)
            parent = block

    def referenced(self, block: int) -> None:
        """A session took ``block``: it is no longer evictable."""
        self._lru.pop(block, None)

    def unreferenced(self, block: int) -> bool:
        """No session holds ``block`` any more: it stays published, evictable last (True), or it was not
        published and is free (False)."""
        if block in self._key_of:
            self._lru[block] = None
            return True
        return False

    def evict_lru(self) -> tuple[int, list[int]] | None:
        """Unpublish the least recently used evictable block (and the blocks published under it);
        returns it and the unreferenced descendants that became free, or None if nothing is evictable."""
        if not self._lru:
            return None
        block = next(iter(self._lru))
        freed = self.remove(block)
        return block, [b for b in freed if b != block]

    def remove(self, block: int) -> list[int]:
        """Unpublish ``block`` and its descendants (a session is about to overwrite it); returns the ones
        that were evictable (no session holds them: they are free now)."""
        freed, stack = [], [block]
        while stack:
            b = stack.pop()
            key = self._key_of.pop(b, None)
            if key is None:
                continue
            del self._by_key[key]
            if key[0] != _ROOT:
                self._children.get(key[0], set()).discard(b)
            stack.extend(self._children.pop(b, ()))
            if self._lru.pop(b, 0) is None:
                freed.append(b)
        return freed
