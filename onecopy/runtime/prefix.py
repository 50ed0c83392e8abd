"""The prefix index: which KV blocks hold which prompt prefixes, so a new request reuses them.

A tree over token blocks, as vLLM's automatic prefix caching and SGLang's RadixAttention keep one: a
full block of ``block_size`` tokens is published under (its parent block, its tokens), so a lookup
walks a prompt block by block and stops at the first block nobody holds. The key names the parent
block itself, not a hash of the prefix: two prefixes can never collide. When a block leaves the index
(evicted or overwritten), every block published under it leaves too: a recycled block id must never
lead a lookup to a child that was computed after other tokens.
Blocks no session references stay published and evictable, least recently used first. With
``digests`` each published block also has the digest of its whole prefix (`kv_tiers.prefix_digest`):
the key under which an evicted block is kept in the host and disk tiers. No tensors here.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence

from .kv_tiers import ROOT_DIGEST, prefix_digest

_ROOT = -1  # the parent of a prompt's first block


class PrefixIndex:
    """Published blocks by (parent block, tokens), their children, and the evictable ones in LRU order."""

    def __init__(self, block_size: int, digests: bool = False) -> None:
        self.block_size = block_size
        self._digest: dict[int, bytes] | None = {} if digests else None  # block -> its prefix's digest
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

    def evictable_blocks(self, n: int) -> list[int]:
        """The ``n`` evictable blocks evicted first (least recently used first)."""
        return list(itertools.islice(self._lru, n))

    def published(self) -> list[int]:
        """Every published block: the evictable ones least recently used first, then those rows hold."""
        return [*self._lru, *(b for b in self._key_of if b not in self._lru)]

    def digest(self, block: int) -> bytes:
        """The digest of the prefix a published ``block`` ends (the index keeps digests)."""
        assert self._digest is not None
        return self._digest[block]

    def publish(self, blocks: Sequence[int], tokens: Sequence[int], known: dict[int, bytes] | None = None) -> None:
        """Publish the full blocks of a session that holds ``tokens`` in ``blocks`` (its table, in order).
        A block already published stays as it is; a prefix another block already holds is left private (its
        first holder keeps serving it) and the session's later blocks are published under that holder, the same
        prefix (two sessions that computed one prompt at once: the second's reply stays reusable).
        ``known``: digests of ``tokens``' blocks by index, computed already."""
        parent, bs, digests = _ROOT, self.block_size, self._digest
        for i in range(min(len(tokens) // bs, len(blocks))):
            block, key = blocks[i], (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            if self._key_of.get(block) != key:
                if block in self._key_of:
                    return  # another prefix lives here: the chain stops
                if key in self._by_key:
                    parent = self._by_key[key]  # this prefix lives elsewhere: go on under its holder
                    continue
                self._by_key[key] = block
                self._key_of[block] = key
                if parent != _ROOT:
                    self._children[parent].add(block)
                if digests is not None:
                    digest = known.get(i) if known else None
                    digests[block] = digest or prefix_digest(digests[parent] if parent != _ROOT else ROOT_DIGEST, key[1])
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

    def evict_lru(self) -> tuple[int, list[int], list[tuple[int, bytes]]] | None:
        """Unpublish the least recently used evictable block (and the blocks published under it); returns
        it, the unreferenced descendants that became free, and (with digests) each of those blocks with its
        prefix's digest (their bytes are intact: the tiers may keep them), or None if nothing is evictable."""
        if not self._lru:
            return None
        block = next(iter(self._lru))
        freed, digests = self._remove(block)
        return block, [b for b in freed if b != block], [(b, digests[b]) for b in freed if b in digests]

    def remove(self, block: int) -> list[int]:
        """Unpublish ``block`` and its descendants (a session is about to overwrite it); returns the ones
        that were evictable (no session holds them: they are free now)."""
        return self._remove(block)[0]

    def _remove(self, block: int) -> tuple[list[int], dict[int, bytes]]:
        freed, digests, stack = [], {}, [block]
        while stack:
            b = stack.pop()
            key = self._key_of.pop(b, None)
            if key is None:
                continue
            del self._by_key[key]
            if key[0] != _ROOT:
                self._children.get(key[0], set()).discard(b)
            stack.extend(self._children.pop(b, ()))
            digest = self._digest.pop(b, None) if self._digest is not None else None
            if self._lru.pop(b, 0) is None:
                freed.append(b)
                if digest is not None:
                    digests[b] = digest
        return freed, digests
