"""Memory accounting: bytes we own, summed, and what the device itself reports.

AOTInductor allocates with raw cudaMalloc, so torch's allocator statistics miss it: on CUDA the
device figure comes from cudaMemGetInfo; on CPU it is the process's resident set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


def device_used(device: torch.device, sync: bool = True) -> int:
    """Bytes in use on the device as the device sees it (CUDA), or this process's RSS (CPU).

    ``sync=False`` reads without waiting for queued work (metrics scraped while the device runs).
    """
    if device.type == "cuda":
        if sync:
            torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available_bytes(device: torch.device) -> int:
    """Free device memory (CUDA), or the host's MemAvailable (CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def _mib(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:,.1f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:,.1f} KiB"


@dataclass
class MemoryReport:
    """What one Engine holds. Printing it gives a table."""

    device: str
    unique_weight_bytes: int  # every weight FQN any method needs, counted once
    resident_weight_bytes: int  # weights really held: the store plus copies inside embedded packages
    duplicated_weight_bytes: int  # resident minus unique: 0 when every method shares the store
    state_bytes: int  # state rows of the open sessions
    sessions_open: int
    state_bytes_per_session: int  # one pool row
    device_used_bytes: int  # growth of device use since just before the Engine loaded (device-level)
    device_total_used_bytes: int  # device use now, whoever holds it
    capacity: int  # sessions that can still be opened (free pool rows)
    pool_rows: int = 0  # sessions the state pool holds (plus one scratch row)
    pool_bytes: int = 0  # the whole pool, allocated at load
    pool_sizing: str = ""  # why the pool has that many rows
    sampler_bytes: int = 0  # per-row sampling tables (repetition penalty, suppressed ids)
    graph_buckets: list[int] = field(default_factory=list)  # batch sizes with a captured decode graph
    graph_bytes: int = 0  # device bytes of the captured graphs and their runners (measured at capture)
    workspace_bytes: int = 0  # named static buffers
    deterministic: bool = False
    notes: list[str] = field(default_factory=list)
    # Paged KV (0 without): blocks of kv_block_size positions, by who references them.
    kv_block_size: int = 0
    kv_blocks: int = 0
    kv_dtype: str = ""  # the cache's storage (`Manifest.kv_dtype_description`): values' dtype, scales if 8-bit
    kv_block_bytes: int = 0  # one block of every layer's K and V (and scales)
    kv_shared_bytes: int = 0  # blocks two or more sessions read (a shared prompt: held once)
    kv_private_bytes: int = 0  # blocks one session reads
    kv_evictable_bytes: int = 0  # cached prefixes no session holds: reused by later prompts, evicted LRU first
    kv_free_bytes: int = 0
    kv_references: int = 0  # block references summed over sessions (what unshared KV would take, in blocks)
    prefix_cache: bool = False
    prefix_cached_tokens: int = 0  # prompt tokens taken from the cache instead of prefilled, since load
    packed_weight_bytes: int = 0  # of the unique weights: the packed (quantized) layers' values, scales, mins
    packed_as_float_bytes: int = 0  # what those layers would take in the model dtype

    def __str__(self) -> str:
        buckets = ",".join(map(str, self.graph_buckets)) or "none"
        rows = [
            ("device", self.device),
            ("unique weights", _mib(self.unique_weight_bytes)),
            ("resident weights", _mib(self.resident_weight_bytes)),
            ("duplicated weights", _mib(self.duplicated_weight_bytes)),
            *([("packed weights (as float)", f"{_mib(self.packed_weight_bytes)} ({_mib(self.packed_as_float_bytes)})")]
              if self.packed_weight_bytes else []),
            ("state pool", f"{self.pool_rows} rows + scratch, {_mib(self.pool_bytes)}"),
            ("state per session", _mib(self.state_bytes_per_session)),
            *([("KV blocks", f"{self.kv_blocks} x {self.kv_block_size} positions"),
               ("KV block", f"{self.kv_block_bytes / 2**10:,.1f} KiB"),
               ("KV shared / private", f"{_mib(self.kv_shared_bytes)} / {_mib(self.kv_private_bytes)}"),
               ("KV cached (evictable)", _mib(self.kv_evictable_bytes)),
               ("KV free", _mib(self.kv_free_bytes))] if self.kv_blocks else []),
            ("sessions open", str(self.sessions_open)),
            ("sessions that still fit", str(self.capacity)),
            ("decode graphs (batch sizes)", buckets),
            ("graphs + runners", _mib(self.graph_bytes)),
            ("workspace + sampler", _mib(self.workspace_bytes + self.sampler_bytes)),
            ("device used by engine", _mib(self.device_used_bytes)),
            ("device used (total)", _mib(self.device_total_used_bytes)),
        ]
        w = max(len(k) for k, _ in rows)
        lines = [f"{k:<{w}}  {v:>14}" for k, v in rows] + [f"pool sizing: {self.pool_sizing}"]
        if self.kv_blocks:
            lines.append(f"kv dtype: {self.kv_dtype}")
            lines.append(f"prefix cache: {'on' if self.prefix_cache else 'off'}, {self.prefix_cached_tokens} prompt "
                         "tokens taken from it")
        if self.deterministic:
            lines.append("deterministic: the batch-invariant decode (a session's bits never depend on its neighbours)")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])
