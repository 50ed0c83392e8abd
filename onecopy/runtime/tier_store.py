"""The bytes of the KV tiers (`kv_tiers`): pinned host slots of one KV block each, and the files of the
disk tier, with the state operations that move blocks between them and the device.

A file is ``<key hex>.kv``: a header (the model's fingerprint and the block's state layout), the key, a
SHA-256 of the payload, then each paged FQN's block bytes in sorted FQN order. It is written whole under a
temporary name and renamed, and read (checked) when a load is decided (`kv_tiers.TierIndex.load`): one
that does not check is a miss, never a block of wrong bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from ..bundle import TensorSpec
from .pool import carve

log = logging.getLogger(__name__)

_MAGIC = b"ONECOPYKV1\n"
_SUFFIX = ".kv"


class TierStore:
    """The tiers' bytes: ``host_slots`` pinned host slots of one KV block each (every paged FQN), and the
    files of ``directory`` (None: no disk tier), for a model of ``fingerprint``."""

    def __init__(self, specs: dict[str, TensorSpec], host_slots: int, directory: Path | None, fingerprint: str,
                 device: torch.device) -> None:
        self.specs, self.device, self.fingerprint = specs, device, fingerprint
        self.fqns = sorted(specs)
        self.buffer, self.slots = carve(specs, host_slots, torch.device("cpu"),
                                        pin_memory=device.type == "cuda" and host_slots > 0)
        self.directory = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.header = _MAGIC + json.dumps({"fingerprint": fingerprint, "state": {
            k: [list(specs[k].shape), specs[k].dtype] for k in self.fqns}}, sort_keys=True).encode() + b"\n"
        self.block_bytes = sum(specs[k].nbytes for k in self.fqns)
        self.file_bytes = len(self.header) + 16 + 32 + self.block_bytes  # header, key, checksum, payload

    @property
    def host_bytes(self) -> int:
        """Host memory the slots hold (pinned on CUDA)."""
        return self.buffer.numel() if any(t.numel() for t in self.slots.values()) else 0

    def keys_on_disk(self) -> list[bytes]:
        """The keys of this model's files that have the right size, least recently used first (the rest are
        left alone: a file being written by another engine, or not a block)."""
        if self.directory is None:
            return []
        found = []
        for entry in os.scandir(self.directory):
            name = entry.name
            if not name.endswith(_SUFFIX) or len(name) != 32 + len(_SUFFIX):
                continue
            try:
                st = entry.stat()
                key = bytes.fromhex(name[:32])
            except (OSError, ValueError):
                continue
            if st.st_size == self.file_bytes:
                found.append((st.st_mtime_ns, key))
        return [k for _, k in sorted(found)]

    # -- operations (block_tensors.BlockTensors.apply calls these in order) ------------------------------
    def save(self, blocks: dict[str, torch.Tensor], block: int, slot: int) -> None:
        for fqn, t in blocks.items():
            self.slots[fqn][slot].copy_(t[block], non_blocking=True)

    def load(self, blocks: dict[str, torch.Tensor], slot: int, block: int) -> None:
        for fqn, t in blocks.items():
            t[block].copy_(self.slots[fqn][slot], non_blocking=True)

    def spill(self, slot: int, key: bytes) -> None:
        self._sync()  # the slot's copy from the device has landed
        self._write(key, [self.slots[f][slot] for f in self.fqns])

    def save_file(self, blocks: dict[str, torch.Tensor], block: int, key: bytes) -> None:
        self._write(key, [blocks[f][block] for f in self.fqns])

    def load_payload(self, blocks: dict[str, torch.Tensor], payload: bytes, block: int) -> None:
        """A file's checked payload (`read`) into ``block``."""
        host = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        start = 0
        for fqn in self.fqns:
            n = self.specs[fqn].nbytes
            blocks[fqn][block].view(torch.uint8).view(-1).copy_(host[start:start + n])
            start += n

    def drop(self, key: bytes) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass

    # -- files -------------------------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        assert self.directory is not None
        return self.directory / (key.hex() + _SUFFIX)

    def _write(self, key: bytes, parts: list[torch.Tensor]) -> None:
        # Copies (numpy's view would pin the storage's size: the pool's buffer is resized to 0 at close).
        payload = b"".join(p.to("cpu", copy=True).contiguous().view(torch.uint8).numpy().tobytes() for p in parts)
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(self.header + key + hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, path)
        except OSError:  # a full or read-only disk: the block is not kept, nothing else breaks
            log.exception("could not write KV block %s to %s", key.hex(), path)
            tmp.unlink(missing_ok=True)

    def read(self, key: bytes) -> bytes | None:
        """The payload of ``key``'s file if it is this model's block of that key, whole (its checksum); else
        None, logged, and a file that is there but does not check is deleted (it would miss again)."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except OSError:
            log.warning("KV block file %s is gone; its prefix is prefilled again", path)
            return None
        h = len(self.header)
        payload = data[h + 48:]
        if len(data) != self.file_bytes or data[:h] != self.header or data[h:h + 16] != key or \
                hashlib.sha256(payload).digest() != data[h + 16:h + 48]:
            log.error("KV block file %s is not this model's block %s or fails its checksum: deleted, its prefix "
                      "prefilled again", path, key.hex())
            path.unlink(missing_ok=True)
            return None
        return payload

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
