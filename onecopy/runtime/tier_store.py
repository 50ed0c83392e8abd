"""The bytes of the KV tiers (`kv_tiers`): pinned host slots of one KV block each, and the files of the disk
tier, with the state operations that move blocks between them and the device.

A slot, a file's payload and a transfer's staging row hold one block the same way: each paged FQN's bytes of
that block, in sorted FQN order. A run of tier operations moves its blocks together: one gather or scatter
kernel per FQN on the device and one copy per run of consecutive slots between host and device, not a copy
per block and FQN (H200, 8-layer 8B shape: 256 blocks of 512 KiB loaded in 64 ms one by one).
A file is ``<key hex>.kv``: a header (the model's fingerprint and the block's state layout), the key, a CRC-32
of the payload, then the payload. It is written whole under a temporary name and renamed, and read (checked)
when a load is decided (`kv_tiers.TierIndex.load`): one that does not check is a miss, never wrong bytes; a
restore's files are read together, on several threads, into one page-locked buffer.
On CUDA the copies to the host run on a stream of their own (the step's stream gathers the blocks first, and
waits for a slot's copy only before reading that slot back), so saving blocks overlaps loads and steps.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..bundle import TensorSpec, parse_dtype
from ..sampling import to_device
from ..state_files import oldest_first
from .plan import DropFile, LoadBlock, LoadFile, SaveBlock, SaveFile, SpillSlot, StateOp

log = logging.getLogger(__name__)

_MAGIC = b"ONECOPYKV1\n"
_SUFFIX = ".kv"
_KEY = re.compile(r"[0-9a-f]{32}")  # a file's name: its key in hex
_STAGING_BYTES = 64 << 20  # device bytes a transfer stages at once (a run of blocks moves in pieces this size)


class TierStore:
    """The tiers' bytes: ``host_slots`` pinned host slots of one KV block each (every paged FQN), and the
    files of ``directory`` (None: no disk tier), for a model of ``fingerprint``."""

    def __init__(self, specs: dict[str, TensorSpec], host_slots: int, directory: Path | None, fingerprint: str,
                 device: torch.device) -> None:
        self.specs, self.device, self.fingerprint = specs, device, fingerprint
        self.fqns = sorted(specs)
        self.offsets, offset = {}, 0
        for fqn in self.fqns:  # each FQN's bytes within a block's row
            assert offset % parse_dtype(specs[fqn].dtype).itemsize == 0, fqn
            self.offsets[fqn] = offset
            offset += specs[fqn].nbytes
        self.block_bytes = offset
        self.pinned = device.type == "cuda"
        self.slots = torch.zeros((host_slots, self.block_bytes), dtype=torch.uint8)
        self._registered = self.pinned and host_slots > 0 and _register(self.slots)
        if self.pinned and host_slots > 0 and not self._registered:
            # torch's pinned allocator rounds a block up to a power of two: up to twice the bytes asked for
            log.warning("could not page-lock the KV host tier in place; pinning a copy (may take up to twice %d bytes)",
                        self.slots.numel())
            self.slots = self.slots.pin_memory()
        self.directory = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.header = _MAGIC + json.dumps({"fingerprint": fingerprint, "state": {
            k: [list(specs[k].shape), specs[k].dtype] for k in self.fqns}}, sort_keys=True).encode() + b"\n"
        self.file_bytes = len(self.header) + 16 + 4 + self.block_bytes  # header, key, CRC-32, payload
        self._readers: ThreadPoolExecutor | None = None
        # Saves copy to the host on their own stream: the copies of the blocks a restore evicts (device to host)
        # overlap its loads (host to device) and the prefill after them, instead of coming before them.
        self._saving = torch.cuda.Stream(device) if self.pinned else None
        self._in_flight: set[int] = set()  # slots whose copies the step's stream has not waited for
        self._host_pending = False  # copies the host has not waited for (before it reads a slot or lets go)

    @property
    def host_bytes(self) -> int:
        """Host memory the slots hold (pinned on CUDA)."""
        return self.slots.numel()

    def keys_on_disk(self) -> list[bytes]:
        """The keys of this model's files that have the right size, least recently used first (the rest are
        left alone: a file being written by another engine, or not a block)."""
        if self.directory is None:
            return []
        return [bytes.fromhex(stem) for stem, size in oldest_first(self.directory, _KEY, _SUFFIX)
                if size == self.file_bytes]

    def has_file(self, key: bytes) -> bool:
        """Whether ``key``'s file is in the directory with the size of this model's block (its bytes are
        checked when it is read)."""
        try:
            return self.directory is not None and self._path(key).stat().st_size == self.file_bytes
        except OSError:
            return False

    # -- operations (block_tensors.BlockTensors.apply hands over each run of them, in order) --------------
    def apply(self, ops: Sequence[StateOp], blocks: dict[str, torch.Tensor]) -> None:
        """Carry out a run of tier operations, in effect in order: cut where a slot or key comes again, each
        piece as spills (the slots' old bytes to files), saves and loads, then deletions."""
        piece: list[StateOp] = []
        seen: set[object] = set()
        for op in ops:
            touched = {getattr(op, "slot", None), getattr(op, "key", None)} - {None}
            if touched & seen:
                self._apply_piece(piece, blocks)
                piece, seen = [], set()
            piece.append(op)
            seen |= touched
        self._apply_piece(piece, blocks)

    def _apply_piece(self, ops: list[StateOp], blocks: dict[str, torch.Tensor]) -> None:
        spills = [op for op in ops if isinstance(op, SpillSlot)]
        if spills:
            self._wait_saves()  # the slots' copies from the device have landed
            for op in spills:
                self._write(op.key, self.slots[op.slot])
        saves = [op for op in ops if isinstance(op, SaveBlock)]
        if saves:
            self._to_host(blocks, [op.block for op in saves], [op.slot for op in saves])
        files = [op for op in ops if isinstance(op, SaveFile)]
        for part in self._pieces(len(files)):  # in pieces: at close every cached block comes this way
            rows = self._gather(blocks, [op.block for op in files[part]]).cpu()
            for op, row in zip(files[part], rows):
                self._write(op.key, row)
        loads = [op for op in ops if isinstance(op, LoadBlock | LoadFile)]
        if loads:
            self._from_host(blocks, loads)
        for op in ops:
            if isinstance(op, DropFile):
                self.drop(op.key)

    def _pieces(self, n: int) -> list[slice]:
        """``n`` blocks in pieces of at most _STAGING_BYTES."""
        step = max(1, _STAGING_BYTES // self.block_bytes)
        return [slice(i, i + step) for i in range(0, n, step)]

    def _gather(self, blocks: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
        """Rows [len(ids), block_bytes] on the device: the blocks ``ids``, each FQN's bytes at its offset (as
        bytes: float8 has no gather kernel)."""
        idx = to_device(torch.tensor(ids, dtype=torch.long), self.device)
        rows = torch.empty((len(ids), self.block_bytes), dtype=torch.uint8, device=self.device)
        for fqn, t in blocks.items():
            part = t.view(torch.uint8).index_select(0, idx).view(len(ids), -1)
            rows[:, self.offsets[fqn]:self.offsets[fqn] + part.shape[1]].copy_(part)
        return rows

    def _scatter(self, blocks: dict[str, torch.Tensor], ids: list[int], rows: torch.Tensor) -> None:
        """`_gather`'s rows written into the blocks ``ids``."""
        idx = to_device(torch.tensor(ids, dtype=torch.long), self.device)
        for fqn, t in blocks.items():
            b = t.view(torch.uint8)
            o = self.offsets[fqn]
            b.index_copy_(0, idx, rows[:, o:o + self.specs[fqn].nbytes].view(len(ids), *b.shape[1:]))

    def _to_host(self, blocks: dict[str, torch.Tensor], ids: list[int], slots: list[int]) -> None:
        for k, part in enumerate(self._pieces(len(ids))):
            if k >= 2 and self._saving is not None:  # two pieces' staging in flight at most: device memory is the KV's
                torch.cuda.current_stream(self.device).wait_stream(self._saving)
            rows = self._gather(blocks, ids[part])  # the blocks' bytes now, on the step's stream
            if self._saving is None:
                for i, j, n in _runs(list(enumerate(slots[part]))):
                    self.slots[j:j + n].copy_(rows[i:i + n])
                continue
            # after the gather, and after every load the step's stream has queued from these slots
            self._saving.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._saving):
                for i, j, n in _runs(list(enumerate(slots[part]))):
                    self.slots[j:j + n].copy_(rows[i:i + n], non_blocking=True)
            rows.record_stream(self._saving)  # not reused by the step's stream before the copies are done
            self._in_flight.update(slots[part])
            self._host_pending = True

    def _from_host(self, blocks: dict[str, torch.Tensor], loads: list[StateOp]) -> None:
        if self._in_flight & {op.slot for op in loads if isinstance(op, LoadBlock)}:
            # a slot saved a moment ago: its bytes land before the step's stream reads them
            torch.cuda.current_stream(self.device).wait_stream(self._saving)
            self._in_flight.clear()
        for part in self._pieces(len(loads)):
            ops = loads[part]
            rows = torch.empty((len(ops), self.block_bytes), dtype=torch.uint8, device=self.device)
            for i, j, n in _runs([(i, op.slot) for i, op in enumerate(ops) if isinstance(op, LoadBlock)]):
                rows[i:i + n].copy_(self.slots[j:j + n], non_blocking=self.pinned)
            for i, payloads in _file_runs(ops):  # a run of one read's rows: one copy
                rows[i:i + len(payloads)].copy_(payloads, non_blocking=self.pinned)
            self._scatter(blocks, [op.block for op in ops], rows)

    def _wait_saves(self) -> None:
        """Every copy to the host has landed (before the host reads a slot, or lets the slots go)."""
        if self._saving is not None and self._host_pending:
            self._saving.synchronize()
            self._host_pending = False
            self._in_flight.clear()

    def close(self) -> None:
        """Give the host slots' page lock back (their memory goes with this object) and the readers' threads."""
        self._wait_saves()
        if self._readers is not None:
            self._readers.shutdown()
            self._readers = None
        if self._registered:
            _unregister(self.slots)
            self._registered = False

    # -- files -------------------------------------------------------------------------------------------
    def drop(self, key: bytes) -> None:
        """Delete ``key``'s file; a file system that refuses is logged (the file stays, counted out)."""
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError:
            log.exception("could not delete KV block file %s", self._path(key))

    def _path(self, key: bytes) -> Path:
        assert self.directory is not None
        return self.directory / (key.hex() + _SUFFIX)

    def _write(self, key: bytes, row: torch.Tensor) -> None:
        payload = row.numpy().tobytes()
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(self.header + key + zlib.crc32(payload).to_bytes(4, "little") + payload)
            os.replace(tmp, path)
        except OSError:  # a full or read-only disk: the block is not kept, nothing else breaks
            log.exception("could not write KV block %s to %s", key.hex(), path)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass

    def read(self, keys: Sequence[bytes]) -> list[torch.Tensor | None]:
        """The payloads of ``keys``' files (rows of one host tensor, pinned on CUDA: a run of them loads in one
        asynchronous copy), read on several threads; None for a file that is gone or is not this model's block
        of that key, whole (its CRC-32): logged, and a file that is there but does not check is deleted (it
        would miss again)."""
        data = torch.empty((len(keys), self.block_bytes), dtype=torch.uint8, pin_memory=self.pinned)
        return self._read_rows(keys, [data[i] for i in range(len(keys))])

    def read_to_slots(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        """Read ``keys``' files into host ``slots`` (free ones: no copy reads or writes them), checked as `read`
        checks; whether each holds its block now."""
        return [p is not None for p in self._read_rows(keys, [self.slots[s] for s in slots])]

    def _read_rows(self, keys: Sequence[bytes], rows: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """`_read_into` of each key's file into its row, on the readers' threads when there are several."""
        if len(keys) < 2:
            return [self._read_into(k, r) for k, r in zip(keys, rows)]
        if self._readers is None:  # file reads and CRC-32s release the GIL: a 4k-token history reads 256 files
            self._readers = ThreadPoolExecutor(min(16, os.cpu_count() or 1), thread_name_prefix="onecopy-kv-read")
        return list(self._readers.map(self._read_into, keys, rows))

    def _read_into(self, key: bytes, payload: torch.Tensor) -> torch.Tensor | None:
        path = self._path(key)
        head = bytearray(len(self.header) + 20)  # header, key, CRC-32
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            log.warning("KV block file %s is gone; its prefix is prefilled again", path)
            return None
        try:
            got = _read_full(fd, [memoryview(head), memoryview(payload.numpy())])
            extra = os.read(fd, 1)
        except OSError:
            log.exception("could not read KV block file %s; its prefix is prefilled again", path)
            return None
        finally:
            os.close(fd)
        h = len(self.header)
        if got != self.file_bytes or extra or head[:h] != self.header or head[h:h + 16] != key or \
                zlib.crc32(payload.numpy()).to_bytes(4, "little") != head[h + 16:h + 20]:
            log.error("KV block file %s is not this model's block %s or fails its checksum: deleted, its prefix "
                      "prefilled again", path, key.hex())
            self.drop(key)
            return None
        return payload


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of ``pairs`` (index, slot) where both go up by one."""
    out: list[tuple[int, int, int]] = []
    for i, s in pairs:
        if out and out[-1][1] + out[-1][2] == s and out[-1][0] + out[-1][2] == i:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, s, 1))
    return out


def _read_full(fd: int, views: list[memoryview]) -> int:
    """Read into ``views`` in order until they are full or the file ends (a read may return less than asked);
    the bytes read."""
    total, got = sum(len(v) for v in views), 0
    while got < total:
        rest, skip = [], got
        for v in views:
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        n = os.readv(fd, rest)
        if n == 0:
            break
        got += n
    return got


def _file_runs(ops: Sequence[StateOp]) -> list[tuple[int, torch.Tensor]]:
    """(first index, payloads [n, block bytes]) of each run of ``ops``' LoadFile operations whose payloads are
    consecutive rows of one host tensor (`TierStore.read`'s)."""
    out: list[tuple[int, torch.Tensor, int]] = []  # first index, first payload, length
    for i, op in enumerate(ops):
        if not isinstance(op, LoadFile):
            continue
        p = op.payload
        if out:
            first, q, n = out[-1]
            if first + n == i and p.untyped_storage().data_ptr() == q.untyped_storage().data_ptr() and \
                    p.storage_offset() == q.storage_offset() + n * q.numel():
                out[-1] = (first, q, n + 1)
                continue
        out.append((i, p, 1))
    return [(i, p.as_strided((n, p.numel()), (p.numel(), 1))) for i, p, n in out]


def _register(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory in place for the device's asynchronous copies (cudaHostRegister: exactly its bytes,
    where a pinned allocation is rounded up to a power of two); False if the driver refuses."""
    try:
        return int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)) == 0
    except (AttributeError, RuntimeError):
        return False


def _unregister(t: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    except (AttributeError, RuntimeError):
        log.exception("could not unregister the KV host tier's memory")
