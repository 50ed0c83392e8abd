"""KV blocks past the device: cached prefixes the device evicts kept in host memory, then on disk, and loaded back
into fresh device blocks instead of prefilled again. A block the prefix cache keeps (no row holds it) is copied
to a free host slot as soon as it is kept (beside the steps, while the host tier has room), and when the cache
evicts a block not saved yet (no row holds it, least recently used), its bytes are saved to a host slot first;
when the host slots are full the least recently used slot is written to a file of the disk tier (or dropped
without one). A block's key is a digest of its whole prefix (every token from position 0), so a block saved by
one engine is found by any engine of the same model on the same directory, after a restart too. A prompt whose
prefix the device cache does not hold is looked up here block by block, after the device's blocks; what is found
is loaded instead of prefilled.

Two halves, as the device cache has: `TierIndex` here decides (host only: which key lives in which
slot or file, least recently used first) and queues state operations (`plan.SaveBlock` ...);
`tier_store.TierStore` holds the bytes (pinned host slots, the files) and carries the operations out for
`block_tensors.BlockTensors`, in effect in order.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .plan import DropFile, LoadBlock, LoadFile, SaveBlock, SaveFile, SpillSlot, StateOp, StateOps

ROOT_DIGEST = b""  # the parent of a prompt's first block


def prefix_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block holding ``tokens`` after the prefix whose key is ``parent`` (16 bytes of BLAKE2b)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class TierStats:
    """What the tiers did since load: blocks saved from the device, loaded back (by tier), spilled to disk."""

    saved: int = 0
    restored_host: int = 0
    restored_disk: int = 0
    spilled: int = 0
    dropped: int = 0
    load_failures: int = 0  # files that were gone or did not check when a load was decided (a miss)
    warmed: int = 0  # disk blocks read into free host slots at start (`TierIndex.reserve_warm`)


class TierIndex:
    """Which prefix keys live in which host slot or file (host only; callers hold the engine's lock)."""

    def __init__(self, host_slots: int, disk_blocks: int = 0, on_disk: Sequence[bytes] = (),
                 read: Callable[[Sequence[bytes]], list[Any]] | None = None,
                 probe: Callable[[bytes], bool] | None = None) -> None:
        """``on_disk``: the keys the disk tier holds already (at most ``disk_blocks``), least recently used first;
        ``read``: the keys' files' payloads, checked (None for a file that is gone or does not check); ``probe``:
        whether a file of the key is there now (written by another engine on the directory since this one listed
        it: `find`)."""
        self.host_slots, self.disk_blocks, self._read, self._probe = host_slots, disk_blocks, read, probe
        self.ops: StateOps | None = None  # the queue the operations go to (`attach`): its batches date the files
        self._unwritten: dict[bytes, int] = {}  # key -> the batch whose operations write its file
        self.host: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> slot, LRU first
        self._free = list(range(host_slots - 1, -1, -1))
        self.disk: collections.OrderedDict[bytes, None] = collections.OrderedDict((k, None) for k in on_disk)
        self.stats = TierStats()

    def attach(self, ops: StateOps) -> None:
        """The KV manager's queue: operations returned here are queued in its batch ``ops.taken``."""
        self.ops = ops

    @property
    def batch(self) -> int:
        """The batch of state operations being queued (all before it are applied)."""
        return self.ops.taken if self.ops is not None else 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.host or key in self.disk

    def find(self, key: bytes) -> bool:
        """Whether a tier holds ``key``, the disk tier's directory included: a file another engine wrote there
        after this one listed it (a replica on a shared directory, one that closed since) joins the disk tier
        here, as the most recently used (its bytes are checked when it is loaded, as every file's are). A prompt
        looks its blocks up until the first miss, so a prompt no tier holds costs one look at the directory."""
        if key in self.host or key in self.disk:
            return True
        if not self.disk_blocks or self._probe is None or not self._probe(key):
            return False
        drops = self._disk_room()  # room made as for a spill
        if drops and self.ops is not None:
            self.ops.add(*drops)
        self.disk[key] = None
        return True

    def save(self, block: int, key: bytes) -> list[StateOp]:
        """A device block holding the prefix ``key`` is about to be reused: keep its bytes in a host slot (the
        operations, queued before anything writes the block). Without host slots nothing: a disk tier alone
        takes the cached blocks at close (`persist`), not one file write per eviction on the step's path."""
        if key in self.host:
            self.host.move_to_end(key)
            return []
        if key in self.disk:
            self.disk.move_to_end(key)
            return []
        if not self.host_slots:
            return []
        self.stats.saved += 1
        ops: list[StateOp] = []
        if self._free:
            slot = self._free.pop()
        else:
            old, slot = self.host.popitem(last=False)
            if old in self.disk:
                pass  # its file is there already (a block warmed from it)
            elif self.disk_blocks:
                ops += self._to_disk(old, SpillSlot(slot, old))
            else:
                self.stats.dropped += 1
        self.host[key] = slot
        return ops + [SaveBlock(block, slot)]

    def keep(self, block: int, key: bytes) -> list[StateOp]:
        """A device block holding the prefix ``key`` became cached (no row holds it: its bytes are final): copied
        to a free host slot now, while nothing waits for it (the copy runs beside the steps), so that its
        eviction, on some request's path to its first token, copies nothing. Never evicts a slot for it:
        without a free slot, nothing (`save` keeps it when it is evicted)."""
        if not self._free or key in self.host or key in self.disk:
            return []
        self.stats.saved += 1
        self.host[key] = slot = self._free.pop()
        return [SaveBlock(block, slot)]

    def persist(self, device: list[tuple[int, bytes]]) -> list[StateOp]:
        """Every host slot, then the device's published ``device`` blocks (block, key; least recently used
        first), to the disk tier: the operations (the most recent kept where the disk budget runs out)."""
        ops: list[StateOp] = []
        if not self.disk_blocks:
            return ops
        for key, slot in list(self.host.items()):
            if key not in self.disk:
                ops += self._to_disk(key, SpillSlot(slot, key))
        for block, key in device:
            if key in self.disk:
                self.disk.move_to_end(key)
            elif key not in self.host:
                self.stats.saved += 1
                ops += self._to_disk(key, SaveFile(block, key))
        return ops

    def load(self, keys: Sequence[bytes], blocks: Sequence[int]) -> list[StateOp]:
        """The operations that load the prefixes ``keys`` into device ``blocks``, in order, up to the first key no
        tier holds (or whose file is gone, does not check, or is written by operations not applied yet)."""
        ops: list[StateOp] = []
        run = 0  # the keys a tier holds, up to the first it does not
        while run < len(keys) and (keys[run] in self.host or (
                keys[run] in self.disk and self._unwritten.get(keys[run]) != self.batch)):
            run += 1
        disk = [k for k in keys[:run] if k not in self.host]
        # Read (and checked) now, all together (`read` may spread them over threads), not when the loads are
        # applied: a file that does not check is a miss here, where the restore can stop, not wrong bytes there.
        payloads = dict(zip(disk, self._read(disk))) if disk and self._read is not None else {}
        for key, payload in payloads.items():
            if payload is None:  # gone, or did not check (then deleted): not on disk any more
                del self.disk[key]
                self._unwritten.pop(key, None)
                self.stats.load_failures += 1
        for key, block in zip(keys[:run], blocks):
            slot = self.host.get(key)
            if slot is not None:
                self.host.move_to_end(key)
                self.stats.restored_host += 1
                ops.append(LoadBlock(slot, block))
                continue
            if payloads.get(key) is None:
                break
            self._unwritten.pop(key, None)
            self.disk.move_to_end(key)
            self.stats.restored_disk += 1
            ops.append(LoadFile(payloads[key], block))
        return ops

    def reserve_warm(self) -> list[tuple[bytes, int]]:
        """The disk tier's most recently used keys that the host tier lacks, each with a free host slot taken for
        it (as many as there are free slots): an engine starting on a directory reads them in the background
        (`warmed`), so a restarted server's first turns load from host memory, not from files."""
        keys = [k for k in reversed(self.disk) if k not in self.host][:len(self._free)]
        return [(k, self._free.pop()) for k in keys]

    def warmed(self, key: bytes, slot: int, ok: bool) -> None:
        """A `reserve_warm` read ended: the slot holds ``key``'s block if ``ok`` (kept, least recently used first,
        unless the disk tier dropped the key or the host tier took it meanwhile), else it is free again."""
        if ok and key in self.disk and key not in self.host:
            self.host[key] = slot
            self.host.move_to_end(key, last=False)  # warmed blocks go before the blocks this engine used
            self.stats.warmed += 1
        else:
            self._free.append(slot)

    def _to_disk(self, key: bytes, write: StateOp) -> list[StateOp]:
        """``write`` (the operation that writes ``key``'s file), after the deletion of the least recently used file
        where the disk tier is full."""
        ops = self._disk_room()
        self.disk[key] = None
        self._unwritten[key] = self.batch
        self.stats.spilled += 1
        return ops + [write]

    def _disk_room(self) -> list[StateOp]:
        """Room for one more file: where the disk tier is full, its least recently used file leaves (the deletion)."""
        if len(self.disk) < self.disk_blocks:
            return []
        old, _ = self.disk.popitem(last=False)
        self._unwritten.pop(old, None)
        self.stats.dropped += 1
        return [DropFile(old)]


