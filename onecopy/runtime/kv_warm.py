"""A restarted engine's host tier filled from its disk tier in the background.

An engine that starts on a KV directory holding blocks (a restart, or a replica on a shared directory) reads
the disk tier's most recently used blocks into its free host slots on a thread of its own, while it serves:
a conversation resumed after the restart then loads its blocks from host memory (one copy per run of slots)
instead of reading its files on the way to its first token. Slots are taken for the reads under the engine's
lock (`kv_tiers.TierIndex.reserve_warm`); a block joins the host tier only once its file is read and checked
(`TierIndex.warmed`), so no decision ever sees a slot being filled.
"""

from __future__ import annotations

import logging
import threading

from .kv_tiers import TierIndex
from .tier_store import TierStore
from .turn_lock import TurnLock

log = logging.getLogger(__name__)

_BATCH = 64  # blocks read between two takes of the engine's lock


class HostTierWarmer:
    """The thread that reads ``index``'s reserved disk blocks into ``store``'s host slots (see the module doc)."""

    def __init__(self, index: TierIndex, store: TierStore, lock: TurnLock) -> None:
        self.index, self.store, self.lock = index, store, lock
        self._stop = threading.Event()
        with lock:
            self._todo = index.reserve_warm()  # none without free host slots or disk blocks
        self._thread: threading.Thread | None = None
        if self._todo:
            self._thread = threading.Thread(target=self._run, name="onecopy-kv-warm", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        done = 0
        try:
            while done < len(self._todo) and not self._stop.is_set():
                part = self._todo[done:done + _BATCH]
                ok = self.store.read_to_slots([k for k, _ in part], [s for _, s in part])
                with self.lock:
                    for (key, slot), good in zip(part, ok):
                        self.index.warmed(key, slot, good)
                done += len(part)
            log.info("KV host tier warmed with %d blocks from disk", self.index.stats.warmed)
        except Exception:  # a read that raised: the blocks stay on disk, the engine is unaffected
            log.exception("warming the KV host tier from disk")
        finally:
            with self.lock:  # the slots not filled are free again
                for key, slot in self._todo[done:]:
                    self.index.warmed(key, slot, False)

    def stop(self) -> None:
        """End the reads (the one in progress finishes) and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
