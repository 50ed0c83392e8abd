"""Device time per phase of the engine's steps (prefill calls, decode steps), for benchmarks.

With overlapped steps the host runs ahead of the device, so host timers around a call measure the
queueing, not the work: on CUDA each phase is bracketed by timing events, read only when the totals
are asked for (no synchronization inside the steps). On a CPU the calls are synchronous and a host
timer is the device time.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PhaseTimes:
    """Seconds and calls per phase name, accumulated over the steps while it is set on the runner."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.calls[name] += 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.seconds[name] += time.perf_counter() - t0

    def totals(self) -> dict[str, dict[str, float]]:
        """{phase: {"seconds", "calls"}} so far (waits for the phases queued on the device)."""
        for name, start, end in self._pending:
            end.synchronize()
            self.seconds[name] += start.elapsed_time(end) / 1000
        self._pending.clear()
        return {n: {"seconds": round(self.seconds[n], 3), "calls": self.calls[n]} for n in sorted(self.calls)}
