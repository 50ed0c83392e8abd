"""Finished conversations kept on the device, so the next turn prefills only what is new.

A chat request whose prompt starts with the tokens a cached session already holds (its prompt and
reply) continues that session: only the rest of the prompt is prefilled. Entries expire after an
idle TTL, the least recently used one goes when the cache is full, and the scheduler reclaims
idle ones when a waiting request needs a row.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..runtime.session import Session


@dataclass
class _Entry:
    session: Session
    tokens: list[int]  # what the session's state holds, in order
    last_used: float


class ConversationCache:
    """Idle sessions keyed by the tokens in their state. Thread-safe; sessions are closed outside the lock."""

    def __init__(self, ttl_s: float = 600.0, max_entries: int | None = None) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._entries: list[_Entry] = []  # least recently used first
        self._lock = threading.Lock()
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, prompt_ids: list[int]) -> tuple[Session | None, int]:
        """The cached session holding the longest proper prefix of ``prompt_ids`` (removed from the
        cache: it is the caller's now), and how many tokens it already holds; (None, 0) if none.
        Expired entries are passed over, not closed: closing takes the engine's lock, and this runs on
        the server's event loop (`expire` closes them, off the loop)."""
        now = time.monotonic()
        with self._lock:
            best = None
            for e in self._entries:
                n = len(e.tokens)
                if n < len(prompt_ids) and (best is None or n > len(best.tokens)) and prompt_ids[:n] == e.tokens \
                        and not e.session.closed and now - e.last_used <= self.ttl_s:
                    best = e
            if best is None:
                return None, 0
            self._entries.remove(best)
            self.hits += 1
            self.reused_tokens += len(best.tokens)
            return best.session, len(best.tokens)

    def put(self, session: Session, tokens: list[int]) -> None:
        """Keep a finished conversation (``tokens``: exactly what its state holds)."""
        evicted = []
        with self._lock:
            self._entries.append(_Entry(session, list(tokens), time.monotonic()))
            while self.max_entries is not None and len(self._entries) > self.max_entries:
                evicted.append(self._entries.pop(0).session)
        for s in evicted:
            s.close()

    def expire(self) -> int:
        """Close the entries idle for longer than the TTL; how many."""
        now = time.monotonic()
        with self._lock:
            old = [e for e in self._entries if now - e.last_used > self.ttl_s]
            self._entries = [e for e in self._entries if e not in old]
        for e in old:
            e.session.close()
        return len(old)

    # -- the scheduler's Reclaimer protocol ---------------------------------------------------
    def idle(self) -> int:
        return len(self._entries)

    def reclaim(self) -> bool:
        """Close the least recently used conversation to free its row."""
        with self._lock:
            if not self._entries:
                return False
            entry = self._entries.pop(0)
        entry.session.close()
        return True

    def clear(self) -> None:
        with self._lock:
            entries, self._entries = self._entries, []
        for e in entries:
            e.session.close()
