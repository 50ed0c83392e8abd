"""The KV cache manager: which KV blocks each row holds, their reference counts, the free list and the
prefix index, and the decisions about them (copy on write, eviction, block admission). Host only.

A paged state FQN is one tensor of blocks on the device (`block_tensors.BlockTensors`); row r's
positions [i * BS, (i + 1) * BS) live in block ``owned[r][i]``. A block is referenced by every row that
holds it; rows that start with the same prompt share its blocks through the `prefix.PrefixIndex`, and
a row about to write into a block another row (or the index) can read gets its own copy first (copy
on write), so a row never writes what another can read. Blocks no row references but the index still
publishes are evicted least recently used when blocks run out. Every decision that touches device
memory is queued as a state operation (`plan.StateOps`) for the model runner to apply.
Blocks are the capacity, not rows. A request that starts on an empty row (`grows`) is admitted with
the blocks of its prompt and its first new position, and takes one more block each time it crosses
into one (the scheduler preempts the latest such request when none is left: it can be recomputed
from its ids). Admission leaves free the share ``new_token_ratio`` of the blocks running requests may
still take (`to_come`; `fits`). A request that continues a session's state reserves every block it may
write at admission: what its row held before cannot be recomputed.
With tiers (`kv_tiers.TierIndex`), a block that becomes cached (published, no row holds it) is copied to
a free host slot, if there is one, and an evicted cached block is saved to host memory or disk before it is
reused (if it is not there yet), and a fresh request's prefix continues past the device's cached blocks into the tiers: the blocks
found there are loaded into fresh blocks (and published again) instead of prefilled.
A deterministic engine (`KVSpec.aligned`) publishes only what a prefill wrote and starts a request on a cached
prefix cut back to a multiple of its prefill chunk: a hit then gives the bits of the whole prompt prefilled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import SessionCapacityError
from .kv_tiers import ROOT_DIGEST, TierIndex, prefix_digest
from .plan import ClearTable, CopyBlock, SetTable, StateOps, ZeroBlocks
from .prefix import PrefixIndex
from .request import Request


@dataclass(frozen=True)
class KVSpec:
    """The paged cache's shape: ``blocks`` blocks of ``block_size`` positions, a row's table ``width``
    blocks wide (max_seq_len / block_size), ``prefix_cache``: blocks shared across rows by prompt."""

    blocks: int
    width: int
    block_size: int
    prefix_cache: bool
    # A deterministic engine's prefill chunk (0: not deterministic). Its prompts are cut into chunks of this
    # size from position 0 and a prefill's bits depend on the cuts, so a cached prefix it starts on ends at a
    # multiple of it (the rest is then cut where a whole prefill cuts it), and only positions a prefill wrote
    # are published (a prompt's, not the ids a decode step wrote): a hit gives the bits of a whole prefill.
    aligned: int = 0


def common_blocks(a: Sequence[int], b: Sequence[int], block_size: int) -> int:
    """Full blocks two prompts share from their start (b's last token excluded: it is always prefilled)."""
    n = 0
    while (n + 1) * block_size <= min(len(a), len(b) - 1) and a[n * block_size:(n + 1) * block_size] == \
            b[n * block_size:(n + 1) * block_size]:
        n += 1
    return n


class KVCacheManager:
    """Blocks of one paged cache for ``rows`` rows (see the module doc). Callers hold the engine's lock."""

    def __init__(self, spec: KVSpec, rows: int, max_seq_len: int, ops: StateOps, tiers: TierIndex | None = None) -> None:
        self.blocks, self.width, self.block_size = spec.blocks, spec.width, spec.block_size
        self.aligned = spec.aligned
        self.rows, self.max_seq_len, self._ops = rows, max_seq_len, ops
        self.owned: list[list[int]] = [[] for _ in range(rows + 1)]  # each row's blocks, in table order
        self.refs = [0] * spec.blocks
        self._free = list(range(spec.blocks - 1, -1, -1))  # a stack: the lowest block is handed out first
        self.index = PrefixIndex(spec.block_size, digests=tiers is not None) if spec.prefix_cache else None
        self.tiers = tiers if spec.prefix_cache else None
        if self.tiers is not None:
            self.tiers.attach(ops)
        self.copies = 0  # blocks copied on write
        self.peak_used = 0  # the most blocks referenced by rows at once (`reset_peak` starts a new count)
        # Admitted fresh requests whose prompt is not all published yet, by their first block's ids (only a
        # prompt with the same first block can share any of theirs): admitting N at once stays linear.
        self._prefilling: dict[tuple[int, ...], list[Request]] = {}

    # -- capacity ----------------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Blocks a row may still take: the free ones and the evictable cached ones."""
        return len(self._free) + (self.index.evictable if self.index is not None else 0)

    @property
    def used(self) -> int:
        """Blocks some row references."""
        return self.blocks - self.available

    def reset_peak(self) -> None:
        self.peak_used = self.used

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def cost(self, row: int, start: int, upto: int) -> int:
        """Blocks ``row`` must take to write positions [start, upto): new ones and copies on write."""
        have = self.owned[row]
        return max(0, self.blocks_for(upto) - len(have)) + sum(
            1 for b in have[start // self.block_size:] if self._readable(b))

    def _readable(self, block: int) -> bool:
        """Whether another row or the prefix index can read ``block`` (a row writing into it copies it first)."""
        return self.refs[block] > 1 or (self.index is not None and block in self.index)

    # -- a row's blocks --------------------------------------------------------------------------------
    def share(self, row: int, blocks: Sequence[int]) -> None:
        """Start empty ``row`` on ``blocks`` (a cached prefix): each is referenced once more."""
        assert not self.owned[row], "share() starts a row"
        for b in blocks:
            self._reference(b)
        self.owned[row] = list(blocks)
        if blocks:
            self._ops.add(SetTable(row, 0, tuple(blocks)))

    def prepare(self, row: int, start: int, upto: int) -> None:
        """Make positions [start, upto) of ``row`` writable: its own copy of any block there that another
        row or the index can read, and new (zeroed) blocks past its last. SessionCapacityError (nothing
        taken) when the blocks are not there."""
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
            # copy on write: other rows keep the original, and a cached prefix stays cached (with the longer
            # prefixes published under it) instead of being overwritten
            if self._readable(b):
                new = self._take()
                self._ops.add(CopyBlock(b, new))
                self._unreference(b)
                have[i] = new
                self.copies += 1
                changed = min(changed, i)
        while len(have) < self.blocks_for(upto):
            fresh.append(self._take())
            have.append(fresh[-1])
        if fresh:
            self._ops.add(ZeroBlocks(tuple(fresh)))
        if changed < len(have):
            self._ops.add(SetTable(row, changed, tuple(have[changed:])))

    def trim(self, row: int, positions: int) -> None:
        """Drop the blocks of ``row`` past its first ``positions`` positions."""
        keep = self.blocks_for(positions)
        have = self.owned[row]
        if len(have) > keep:
            for b in have[keep:]:
                self._unreference(b)
            del have[keep:]
            self._ops.add(ClearTable(row, keep))

    def release(self, row: int) -> None:
        """Drop every block of ``row`` (its session closed or reset)."""
        self.trim(row, 0)

    def publish(self, row: int, tokens: Sequence[int]) -> None:
        """Offer the full blocks of ``row``, which holds ``tokens`` from position 0, to later prompts."""
        if self.index is not None:
            self.index.publish(self.owned[row], tokens)

    def _publish_request(self, req: Request, tokens: Sequence[int]) -> None:
        """`publish` what ``req``'s row holds, ``tokens`` from position 0; deterministic (`KVSpec.aligned`): only
        its prompt, and only from a row it started empty (a session's earlier ids may be a decode step's)."""
        if self.aligned:
            if req.start or req.base != []:
                return
            tokens = tokens[:len(req.prompt)]
        self.publish(req.row, tokens)

    def lookup(self, tokens: Sequence[int], touch: bool = True) -> list[int]:
        """Cached blocks holding the longest block-aligned prefix of ``tokens`` (none without the cache)."""
        return self.index.lookup(tokens, touch) if self.index is not None else []

    # -- requests (the scheduler's block admission) ------------------------------------------------------
    def span(self, req: Request) -> int:
        """The end of the positions a request may write: its prompt and all but its last new token."""
        end = req.start + len(req.prompt)
        return max(end, min(end + req.params.max_new_tokens - 1, self.max_seq_len))

    @staticmethod
    def grows(req: Request) -> bool:
        """Whether a request takes its blocks as it grows (and may be preempted): it starts on an empty
        row whose every id it knows, so the row can be emptied and filled again from them."""
        return req.start == 0 and req.base is not None

    def admission_end(self, req: Request) -> int:
        """The end of the positions a request's blocks cover when it is admitted: its whole span (a request
        that does not grow, or one that must ``reserve``), else what it reads before its next sample and
        the position of that sample's id."""
        if not self.grows(req) or req.reserve:
            return self.span(req)
        return min(req.start + req.feed_len + 1, self.span(req))

    def check_request(self, req: Request) -> None:
        """SessionCapacityError if the request could never fit, even in an empty cache."""
        span = self.span(req)
        if self.blocks_for(span) > self.blocks:
            raise SessionCapacityError(
                f"the request may write {span} positions ({self.blocks_for(span)} KV blocks of {self.block_size}) and "
                f"the whole KV cache has {self.blocks} blocks; ask for fewer max_new_tokens or a shorter prompt, or "
                "load the engine with more kv_blocks")

    def _cached_prefix(self, req: Request, touch: bool) -> tuple[list[int], list[bytes], int]:
        """The cached blocks what a fresh request reads starts with, the tiers' keys of the whole blocks that
        follow them there, and the ids it takes from both (at least one id is left to prefill: its logits
        are the next sample)."""
        if self.index is None or not req.starts_empty:
            return [], [], 0
        ids = self._cacheable(req)
        found = self.lookup(ids, touch)
        keys = self._tier_keys(ids, found, req.digests) if self.tiers is not None else []
        cached = self._usable((len(found) + len(keys)) * self.block_size, len(ids))
        keys = keys[:max(0, self.blocks_for(cached) - len(found))]
        return found[:self.blocks_for(cached)], keys, cached

    def _cacheable(self, req: Request) -> list[int]:
        """The ids of ``req`` a cached prefix may cover: what it reads, or in a deterministic engine its prompt
        alone (a resumed request's generated ids were written by decode steps)."""
        return req.feed(0, len(req.prompt) if self.aligned else req.feed_len)

    def _usable(self, positions: int, n: int) -> int:
        """How many of ``positions`` cached positions a request reading ``n`` cacheable ids starts on: at least
        one id is left to prefill (its logits are the next sample), and a deterministic engine cuts back to a
        multiple of its prefill chunk (`KVSpec.aligned`)."""
        cached = min(positions, n - 1)
        return cached - cached % self.aligned if self.aligned else cached

    def _tier_keys(self, ids: Sequence[int], found: list[int], known: dict[int, bytes]) -> list[bytes]:
        """The tiers' keys of the whole blocks of ``ids`` after the device's ``found`` ones, up to the first
        the tiers miss (blocks before the last id only: that one is always prefilled). ``known``: the keys
        of ``ids``' blocks by index, as far as computed (completed here)."""
        assert self.tiers is not None and self.index is not None
        bs, keys = self.block_size, []
        parent = known.get(len(found) - 1) or (self.index.digest(found[-1]) if found else ROOT_DIGEST)
        for i in range(len(found), (len(ids) - 1) // bs):
            digest = known.get(i)
            if digest is None:
                digest = known[i] = prefix_digest(parent, ids[i * bs:(i + 1) * bs])
            parent = digest
            if not self.tiers.find(parent):
                break
            keys.append(parent)
        return keys

    def _restore(self, req: Request, keys: list[bytes]) -> int:
        """Load the tiers' blocks ``keys`` into fresh blocks after ``req``'s row's shared ones and publish
        them; returns how many it loaded (a key the saves of these very takes pushed out ends the run)."""
        assert self.tiers is not None and self.index is not None
        have = self.owned[req.row]
        first, fresh = len(have), [self._take() for _ in keys]  # evictions save first: queued before the loads
        loads = self.tiers.load(keys, fresh)
        self._ops.add(*loads)
        loaded = len(loads)
        for block in fresh[loaded:]:
            self.refs[block] = 0
            self._free.append(block)
        if loaded:
            have.extend(fresh[:loaded])
            self._ops.add(SetTable(req.row, first, tuple(fresh[:loaded])))
            self.index.publish(have, req.feed(0, len(have) * self.block_size), req.digests)
        return loaded

    def to_come(self, req: Request, ratio: float) -> float:
        """The blocks a request that grows may still take (its span's past those it holds) times ``ratio``."""
        if not self.grows(req):
            return 0.0
        return ratio * max(0, self.blocks_for(self.span(req)) - max(len(self.owned[req.row]) if req.admitted else 0,
                                                                    self.blocks_for(self.admission_end(req))))

    def fits(self, req: Request, promised: float = 0.0, ratio: float = 0.0) -> bool:
        """Whether the blocks a request needs at admission are free or evictable now, beside ``promised`` (the
        blocks running requests may still take, `to_come`) and ``ratio`` of what this one may take after (and
        no prompt being prefilled holds more of its prefix than the cache does: then it waits to share that
        prompt's blocks)."""
        end = self.admission_end(req)
        headroom = self.available - promised - self.to_come(req, ratio)
        if not req.starts_empty:
            return self.cost(req.row, req.start, end) <= headroom
        shared, keys, cached = self._cached_prefix(req, touch=False)
        if self.index is not None and self._prefilling:
            # wait for a prompt being prefilled only where its blocks would give this one more cached positions
            ids = self._cacheable(req)
            if any(self._usable(common_blocks(self._cacheable(p), ids, self.block_size) * self.block_size,
                                len(ids)) > cached for p in self._prefilling.get(self._prefilling_key(req), ())):
                return False
        need = self.blocks_for(end) - len(shared) + (1 if cached % self.block_size else 0)
        return need <= headroom - sum(1 for b in shared if self.refs[b] == 0)

    def place(self, req: Request) -> None:
        """Give an admitted request its blocks: an empty row starts on the cached prefix of what it reads
        (sets ``req.cached``), then the positions up to `admission_end` are made its own."""
        if req.starts_empty:
            shared, keys, req.cached = self._cached_prefix(req, touch=True)
            self.share(req.row, shared)
            if keys:
                loaded = self._restore(req, keys)
                if loaded < len(keys):  # cut short: what the row holds now, cut back as the lookup cuts
                    req.cached = self._usable(min(req.cached, (len(shared) + loaded) * self.block_size),
                                              len(self._cacheable(req)))
                    self.trim(req.row, req.cached)
            key = self._prefilling_key(req)
            if self.index is not None and key is not None:
                self._prefilling.setdefault(key, []).append(req)
        self.prepare(req.row, req.start + req.cached, self.admission_end(req))

    def prefilled(self, req: Request) -> None:
        """A request's prompt is in its row (the step is queued): later prompts may start on its blocks."""
        self._untrack(req)
        if self.index is not None and req.base is not None:
            self._publish_request(req, req.base + req.feed(0, req.feed_len))

    def preempted(self, req: Request) -> None:
        """A running request gives up its blocks (`grows` is true of it): the ids its row holds are
        published first (with the prefix cache, its next admission starts on those still cached)."""
        self._untrack(req)
        if self.index is not None:
            self._publish_request(req, (req.prompt + req.output)[:req.end])
        self.release(req.row)

    def finished(self, req: Request) -> None:
        """An admitted request ended: publish what its row holds (the conversation so far, for its next
        turn) and drop the blocks it reserved and did not write."""
        self._untrack(req)
        held = req.held
        if held is not None:
            self._publish_request(req, held)
        self.trim(req.row, req.end)

    def persist(self) -> None:
        """Queue the saving of every published block (least recently used first) and every host slot to the
        disk tier (an engine closing: another on the same directory finds them)."""
        if self.tiers is not None and self.index is not None:
            self._ops.add(*self.tiers.persist([(b, self.index.digest(b)) for b in self.index.published()]))

    def copy_ahead(self, limit: int) -> None:
        """Save up to ``limit`` of the cached blocks the device evicts first (among the oldest half host tier's
        worth) that no tier holds yet to the host tier now: called while the engine is idle, so that evicting
        them later, on some request's way to its first token, copies nothing (where `TierIndex.keep` found no
        free slot). What the host tier evicts for them is what their eviction would evict, only sooner."""
        if self.tiers is None or self.index is None or not self.tiers.host_slots:
            return
        for block in self.index.evictable_blocks(max(1, self.tiers.host_slots // 2)):
            if limit <= 0:
                return
            key = self.index.digest(block)
            if key not in self.tiers:
                self._ops.add(*self.tiers.save(block, key))
                limit -= 1

    # -- accounting ---------------------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        """Blocks by kind: shared (referenced by 2+ rows), private (by one), cached (by none, evictable), free."""
        refs = self.refs
        return {"shared": sum(1 for r in refs if r > 1), "private": sum(1 for r in refs if r == 1),
                "cached": self.index.evictable if self.index is not None else 0, "free": len(self._free),
                "references": sum(refs)}

    def free_list(self) -> list[int]:
        """The free blocks, sorted (each exactly once)."""
        return sorted(self._free)

    # -- internals -----------------------------------------------------------------------------------
    def _prefilling_key(self, req: Request) -> tuple[int, ...] | None:
        """The ids of the first block a request reads (None: shorter than a block, it can share none)."""
        return tuple(req.feed(0, self.block_size)) if req.feed_len >= self.block_size else None

    def _untrack(self, req: Request) -> None:
        """``req`` leaves the prompts being prefilled (if it was one)."""
        key = self._prefilling_key(req)
        same = self._prefilling.get(key)
        if same is not None and req in same:
            same.remove(req)
            if not same:
                del self._prefilling[key]

    def _take(self) -> int:
        if not self._free:
            evicted = self.index.evict_lru() if self.index is not None else None
            assert evicted is not None, "callers check `available` first"
            block, freed, saved = evicted
            self._free.extend(freed)
            if self.tiers is not None:  # their bytes kept before anything reuses them
                for b, digest in saved:
                    self._ops.add(*self.tiers.save(b, digest))
        else:
            block = self._free.pop()
        self.refs[block] = 1
        self.peak_used = max(self.peak_used, self.used)
        return block

    def _reference(self, block: int) -> None:
        if self.refs[block] == 0 and self.index is not None:
            self.index.referenced(block)
        self.refs[block] += 1
        self.peak_used = max(self.peak_used, self.used)

    def _unreference(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block]:
            return
        if self.index is None or not self.index.unreferenced(block):
            self._free.append(block)
        elif self.tiers is not None:  # cached now: copied to the host ahead of its eviction where there is room
            self._ops.add(*self.tiers.keep(block, self.index.digest(block)))
