"""Where a CPU engine's torch work runs: `on_short_lived_thread`.

libgomp (the OpenMP under torch's CPU ops and AOTInductor's CPU kernels) gives each thread that starts a
parallel region a team of worker threads of its own and keeps it for as long as that thread lives. Once two
teams exist on a machine with as few cores as threads in them, libgomp stops spinning its workers between
parallel regions (it throttles spinning when it manages more threads than there are CPUs) and every one of a
decode step's hundreds of small regions waits for its workers to wake: SmolLM2 decoded at 19-21 ms a token
from the engine loop's thread when the user's thread had loaded the bundle (a team of its own), 8 ms with one
team (2 cores; `OMP_WAIT_POLICY=PASSIVE` made every thread as slow). So `Engine.load` on a CPU does its work on
a thread that exits when it is done, taking its team along, and the loop's team is the only one.
A leaf: it imports nothing of onecopy's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_short_lived_thread(fn: Callable[[], T], name: str = "onecopy-load") -> T:
    """``fn()`` run on a new thread that ends with it; its result returned, its exception raised here."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller, who raises it
            box["error"] = e

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
