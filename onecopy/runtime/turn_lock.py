"""The engine's lock, with turns: the loop lets a waiting caller in between two steps.

A plain lock gives no turns: the loop thread releases it after a step and takes it back at once, before a thread
waiting on it (a session's direct call, a snapshot) is even woken, so such a call could wait until every running
request had ended. Here each acquirer says it is waiting, and the loop, before taking the lock for its next step,
waits (briefly, bounded) until no one is.
"""

from __future__ import annotations

import threading


class TurnLock:
    """A reentrant lock (``with lock:``, `acquire` / `release`) whose owner of many turns, the loop, calls
    `yield_to_waiters` before each: a thread waiting for the lock then gets it first."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._waiting = 0
        self._turns = threading.Condition(threading.Lock())

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        with self._turns:
            self._waiting += 1
        try:
            return self._lock.acquire(blocking, timeout)
        finally:
            with self._turns:
                self._waiting -= 1
                if not self._waiting:
                    self._turns.notify_all()

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> "TurnLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def yield_to_waiters(self, timeout: float = 1.0) -> None:
        """Wait (at most ``timeout`` s) until no thread is waiting for the lock. Call it without holding the lock."""
        with self._turns:
            if self._waiting:
                self._turns.wait_for(lambda: not self._waiting, timeout)
