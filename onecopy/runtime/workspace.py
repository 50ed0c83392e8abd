"""A named pool of reusable device buffers (static I/O of captured graphs, scratch space).

One buffer per (name, dtype, device): a request that fits returns a view of it (best fit: the
smallest buffer that holds it is the one already there), a larger one replaces it, so the pool
never grows into an unbounded list. Buffers allocated while a CUDA graph is being captured come
from that graph's memory pool (the caching allocator routes them there).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch


class Workspace:
    """Named, typed, per-device scratch buffers. Thread-safe."""

    def __init__(self, zero_on_reuse: bool = False) -> None:
        self.zero_on_reuse = zero_on_reuse
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self._lock = threading.Lock()
        self.replacements = 0  # how often a request outgrew its buffer

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu",
            *, zero: bool | None = None) -> torch.Tensor:
        """A tensor of ``shape`` viewing the buffer for (name, dtype, device).

        The same key always returns the same storage while the request fits. ``zero`` (default:
        the pool's ``zero_on_reuse``) zeroes the returned view.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        numel = math.prod(shape)
        key = (name, dtype, device)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None or buf.numel() < numel:
                if buf is not None:
                    self.replacements += 1
                buf = torch.zeros(max(numel, 1), dtype=dtype, device=device)
                self._buffers[key] = buf
            elif zero if zero is not None else self.zero_on_reuse:
                buf[:numel].zero_()
            return buf[:numel].view(tuple(shape))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def __len__(self) -> int:
        return len(self._buffers)

    def clear(self) -> None:
        """Drop every buffer (views handed out keep their memory alive until they go too)."""
        with self._lock:
            self._buffers.clear()
