"""The rows of the state pool as a host-side free list of leases: who holds which row.

Taking a row gives a `RowLease`; only that lease gives the row back, once. Giving back a lease that
was given back already, or one whose row has been taken again since, is a no-op that says so. So the
paths that end a session (its request ending, its owner closing it, the engine closing) may each give
its row back in any order: the row goes back exactly once and never out from under its next holder.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class RowLease:
    """The right to one row of the pool, from `RowAllocator.take` until it is given back."""

    row: int
    generation: int  # how many times the row was taken before this lease


class RowAllocator:
    """Rows 0..rows-1; the lowest free row is handed out first. Callers hold the engine's lock."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._free = list(range(rows))  # a heap
        self._taken = [0] * rows  # times each row was taken
        self._held: dict[int, RowLease] = {}

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def take(self) -> RowLease:
        """Lease the lowest free row; the caller checks `free_rows` first."""
        row = heapq.heappop(self._free)
        lease = RowLease(row, self._taken[row])
        self._taken[row] += 1
        self._held[row] = lease
        return lease

    def give_back(self, lease: RowLease) -> bool:
        """Put the lease's row back on the free list; False (and nothing changes) unless the lease holds it."""
        if self._held.get(lease.row) != lease:
            return False
        del self._held[lease.row]
        heapq.heappush(self._free, lease.row)
        return True

    def holds(self, lease: RowLease) -> bool:
        return self._held.get(lease.row) == lease

    def free_list(self) -> list[int]:
        """The free rows, sorted (each exactly once)."""
        return sorted(self._free)
