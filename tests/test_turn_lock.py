"""The engine's lock gives turns: a caller waiting for it gets it between two of the loop's steps."""

import threading
import time

from onecopy.runtime.turn_lock import TurnLock


def test_a_waiting_caller_gets_the_lock_between_two_turns():
    lock, turns = TurnLock(), []

    def loop() -> None:  # as the engine's loop: a short turn under the lock, again and again
        for i in range(300):
            lock.yield_to_waiters()
            with lock:
                turns.append(i)
                end = time.perf_counter() + 0.001
                while time.perf_counter() < end:  # a turn's host work (the GIL held, as a step's Python is)
                    pass

    t = threading.Thread(target=loop)
    t.start()
    while not turns:
        time.sleep(0.001)
    asked = len(turns)
    with lock:  # a plain lock's loop takes it back first, turn after turn: this waited for all 300
        got = len(turns)
        assert lock._lock._is_owned()
    t.join()
    assert got - asked <= 3 and len(turns) == 300


def test_it_is_reentrant_and_times_out():
    lock = TurnLock()
    with lock:
        with lock:  # the same thread again
            pass
        out = []
        t = threading.Thread(target=lambda: out.append(lock.acquire(timeout=0.05)))
        t.start()
        t.join()
        assert out == [False]
    lock.yield_to_waiters()  # nobody waits: returns at once
