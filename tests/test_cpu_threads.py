"""A CPU engine loads on a thread that exits (runtime/cpu_threads.py): the caller's thread keeps no OpenMP team
beside the engine loop's, which made every decode step 2.3x slower on 2 cores (benchmarks/packed_cpu.py)."""

from __future__ import annotations

import threading

import pytest

import onecopy
from onecopy.errors import BundleNotFoundError
from onecopy.runtime import method as method_mod
from onecopy.runtime.cpu_threads import on_short_lived_thread


def test_cpu_load_runs_off_the_calling_thread_and_that_thread_is_gone(tiny_bundle, monkeypatch):
    seen: list[threading.Thread] = []
    real_init = method_mod.Method.__init__

    def spy(self, *args, **kwargs):
        seen.append(threading.current_thread())
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(method_mod.Method, "__init__", spy)
    with onecopy.Engine.load(tiny_bundle, "cpu", max_sessions=2) as e:
        assert seen and all(t is not threading.current_thread() and t.name == "onecopy-load" for t in seen)
        assert not any(t.is_alive() for t in seen)
        assert len(list(e.open_session().generate_ids([5, 7, 9], onecopy.SamplingParams(max_new_tokens=3),
                                                       stop_ids=[]))) == 3


def test_a_failed_load_raises_its_own_error_in_the_caller(tmp_path):
    with pytest.raises(BundleNotFoundError, match="does not exist; create it with `onecopy export SOURCE"):
        onecopy.Engine.load(tmp_path / "nothing-here", "cpu")


def test_short_lived_thread_returns_and_raises():
    assert on_short_lived_thread(lambda: threading.current_thread().name) == "onecopy-load"
    with pytest.raises(KeyError, match="x"):
        on_short_lived_thread(lambda: {}["x"])
