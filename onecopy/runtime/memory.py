"""Memory accounting: bytes we own, summed, and what the device itself reports.

AOTInductor allocates with raw cudaMalloc, so torch's allocator statistics miss it: on CUDA the
device figure comes from cudaMemGetInfo; on CPU it is the process's resident set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch


def device_used(device: torch.device) -> int:
    """Bytes in use on the device as the device sees it (CUDA), or this process's RSS (CPU)."""
    if device.type == "cuda":
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
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


@dataclass
class MemoryReport:
    """What one Engine holds. Printing it gives a table."""

    device: str
    unique_weight_bytes: int  # every weight FQN any method needs, counted once
    resident_weight_bytes: int  # weights really held: the store plus copies inside embedded packages
    duplicated_weight_bytes: int  # resident minus unique: 0 when every method shares the store
    state_bytes: int  # state of all open sessions
    sessions_open: int
    state_bytes_per_session: int
    device_used_bytes: int  # growth of device use since just before the Engine loaded (device-level)
    device_total_used_bytes: int  # device use now, whoever holds it
    capacity: int  # sessions that can still be opened
    graph_slots: int = 0  # captured decode graphs (one per session slot)
    free_graph_slots: int = 0
    graph_bytes: int = 0  # device bytes the slots cost beyond their state (runners + graphs)
    workspace_bytes: int = 0  # named static buffers
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        rows = [
            ("device", self.device),
            ("unique weights", _mib(self.unique_weight_bytes)),
            ("resident weights", _mib(self.resident_weight_bytes)),
            ("duplicated weights", _mib(self.duplicated_weight_bytes)),
            ("sessions open", str(self.sessions_open)),
            ("state per session", _mib(self.state_bytes_per_session)),
            ("state (all sessions)", _mib(self.state_bytes)),
            ("sessions that still fit", str(self.capacity)),
            ("graph slots (free)", f"{self.graph_slots} ({self.free_graph_slots})"),
            ("graphs + runners", _mib(self.graph_bytes)),
            ("workspace", _mib(self.workspace_bytes)),
            ("device used by engine", _mib(self.device_used_bytes)),
            ("device used (total)", _mib(self.device_total_used_bytes)),
        ]
        w = max(len(k) for k, _ in rows)
        lines = [f"{k:<{w}}  {v:>14}" for k, v in rows] + [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
