"""Many isolated sessions on one loaded model."""

import json
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import onecopy
from onecopy.bundle import sha256, tensor_bytes
from onecopy.runtime import method as method_mod

from .conftest import copy_bundle

GREEDY = onecopy.SamplingParams(max_new_tokens=12)
PROMPTS = {"A": [5, 9, 33, 2, 71, 8], "B": [100, 3], "C": [7, 7, 7, 250, 1, 19, 40, 41, 42, 43, 44]}


def _solo(engine, prompt, n=12):
    with engine.open_session() as s:
        ids = list(s.generate_ids(prompt, onecopy.SamplingParams(max_new_tokens=n), stop_ids=[]))
        return ids, {k: v.clone() for k, v in s.state.items()}


def test_interleaved_sessions_are_bit_identical_to_solo(tiny_engine):
    solo = {k: _solo(tiny_engine, p) for k, p in PROMPTS.items()}
    sessions = {k: tiny_engine.open_session() for k in PROMPTS}
    streams = {k: sessions[k].generate_ids(p, GREEDY, stop_ids=[]) for k, p in PROMPTS.items()}
    got = {k: [] for k in PROMPTS}
    for _ in range(GREEDY.max_new_tokens):  # one token of each session in turn
        for k, it in streams.items():
            got[k].append(next(it))
    for k in PROMPTS:
        assert got[k] == solo[k][0], k
        for fqn, t in sessions[k].state.items():
            assert torch.equal(t, solo[k][1][fqn]), (k, fqn)


def test_threads_generating_at_once_equal_solo(tiny_engine):
    prompts = [[i + 1, 2 * i + 3, 50 + i] for i in range(6)]
    solo = [_solo(tiny_engine, p, 16)[0] for p in prompts]
    results, errors = [None] * len(prompts), []

    def work(i):
        try:
            with tiny_engine.open_session() as s:
                results[i] = list(s.generate_ids(prompts[i], onecopy.SamplingParams(max_new_tokens=16), stop_ids=[]))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == solo


def test_methods_are_repointed_only_when_the_session_changes(tiny_engine, monkeypatch):
    binds = []
    real = method_mod.Method.bind
    monkeypatch.setattr(method_mod.Method, "bind", lambda self, w, s: (binds.append(self.name), real(self, w, s))[1])
    a, b = tiny_engine.open_session(), tiny_engine.open_session()
    tok = torch.tensor([3])
    a.prefill([1, 2, 3])
    a.decode(tok)
    a.decode(tok)
    a.decode(tok)
    assert binds == ["prefill", "decode"]
    b.decode(tok)
    a.decode(tok)
    a.decode(tok)
    assert binds == ["prefill", "decode", "decode", "decode"]


def test_state_is_allocated_at_open_and_counted_exactly(tiny_engine):
    expected = sum(s.nbytes for s in tiny_engine.manifest.state.values())
    a = tiny_engine.open_session()
    assert a.state_bytes == expected == sum(t.numel() * t.element_size() for t in a.state.values())
    assert tiny_engine.session_bytes >= expected and tiny_engine.session_bytes - expected < 256 * len(a.state)
    assert all(t.abs().sum() == 0 for t in a.state.values())  # zeros before any run
    b = tiny_engine.open_session()
    ptrs_a = {t.data_ptr() for t in a.state.values()}
    assert ptrs_a.isdisjoint(t.data_ptr() for t in b.state.values())
    r = tiny_engine.memory_report()
    assert (r.sessions_open, r.state_bytes, r.state_bytes_per_session) == (2, 2 * expected, expected)
    b.close()
    assert tiny_engine.memory_report().state_bytes == expected


def test_max_sessions_refusal_names_the_numbers(tiny_bundle):
    with onecopy.Engine.load(tiny_bundle, max_sessions=2) as e:
        assert e.capacity() == 2
        e.open_session()
        s = e.open_session()
        assert e.capacity() == 0
        with pytest.raises(onecopy.SessionCapacityError,
                           match=rf"2 sessions are open, one more needs {e.session_bytes} bytes of state, and max_sessions=2"):
            e.open_session()
        s.close()
        assert e.capacity() == 1
        e.open_session()


def test_memory_budget_sizes_capacity(tiny_bundle):
    with onecopy.Engine.load(tiny_bundle, memory_budget=1) as e:
        per = e.session_bytes
    with onecopy.Engine.load(tiny_bundle, memory_budget=int(2.5 * per)) as e:
        assert e.capacity() == 2
        e.open_session(), e.open_session()
        with pytest.raises(onecopy.SessionCapacityError, match=rf"only {per // 2} bytes are free for state"):
            e.open_session()


def test_capacity_follows_available_memory_after_the_reserve(tiny_engine):
    from onecopy.runtime.memory import available_bytes

    want = (available_bytes(tiny_engine.device) - tiny_engine.reserve_bytes) // tiny_engine.session_bytes
    got = tiny_engine.capacity()
    assert 0 < got and abs(got - want) <= want // 50  # MemAvailable moves a little between the two reads
    assert tiny_engine.memory_report().capacity == pytest.approx(got, rel=0.02)


def test_closed_session_errors(tiny_engine):
    s = tiny_engine.open_session()
    s.close()
    s.close()  # idempotent
    for call in (lambda: s.prefill([1, 2]), lambda: s.run("decode", torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)),
                 lambda: next(s.generate_ids([1, 2])), s.reset, s.snapshot):
        with pytest.raises(onecopy.SessionClosedError, match=f"session {s.id} is closed; open a new one"):
            call()


def test_reset_gives_the_same_output_as_a_fresh_session(tiny_engine):
    fresh = _solo(tiny_engine, PROMPTS["C"])[0]
    with tiny_engine.open_session() as s:
        list(s.generate_ids(PROMPTS["A"], GREEDY, stop_ids=[]))
        s.reset()
        assert s.position == 0 and all(t.abs().sum() == 0 for t in s.state.values())
        assert list(s.generate_ids(PROMPTS["C"], GREEDY, stop_ids=[])) == fresh


def _continue(session, n=8):
    last = torch.tensor([session.last_token])
    return list(session.generate_ids([int(last)], onecopy.SamplingParams(max_new_tokens=n), stop_ids=[]))


def test_snapshot_restore_continues_identically(tiny_engine, tmp_path):
    with tiny_engine.open_session() as s:
        first = list(s.generate_ids(PROMPTS["A"], GREEDY, stop_ids=[]))
        snap = s.snapshot()
        s.save(tmp_path / "a.safetensors")
        s.last_token = first[-1]
        want = _continue(s)
    for restore in (snap, tmp_path / "a.safetensors", str(tmp_path / "a.safetensors")):
        with tiny_engine.open_session(restore=restore) as r:
            assert r.position == len(PROMPTS["A"]) + len(first) - 1
            r.last_token = first[-1]
            assert _continue(r) == want


def test_restore_in_a_new_process(tiny_bundle, tmp_path):
    with onecopy.Engine.load(tiny_bundle) as e, e.open_session() as s:
        first = list(s.generate_ids(PROMPTS["B"], GREEDY, stop_ids=[]))
        s.save(tmp_path / "b.safetensors")
        s.last_token = first[-1]
        want = _continue(s)
    code = (
        "import sys, json, onecopy\n"
        f"e = onecopy.Engine.load({str(tiny_bundle)!r})\n"
        f"s = e.open_session(restore={str(tmp_path / 'b.safetensors')!r})\n"
        f"print(json.dumps(list(s.generate_ids([{first[-1]}], onecopy.SamplingParams(max_new_tokens=8), stop_ids=[]))))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == want


def test_restore_refuses_foreign_snapshots(tiny_engine, tmp_path):
    with tiny_engine.open_session() as s:
        s.prefill([1, 2, 3])
        snap = s.snapshot()
    snap.fingerprint = "0" * 64
    with pytest.raises(onecopy.InputError, match="belongs to another model"):
        tiny_engine.open_session(restore=snap)
    assert tiny_engine.sessions_open == 0
    with pytest.raises(onecopy.InputError, match="does not exist"):
        tiny_engine.open_session(restore=tmp_path / "none.safetensors")
    save_file({"x": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(onecopy.InputError, match="not an onecopy session snapshot"):
        tiny_engine.open_session(restore=tmp_path / "plain.safetensors")


def test_undeclared_state_fails_closed(tiny_bundle, tmp_path):
    """A manifest that declares one KV buffer as a weight: sessions would share it, so capacity is 1."""
    bad = copy_bundle(tiny_bundle, tmp_path / "bad")
    m = json.loads((bad / "manifest.json").read_text())
    fqn = "layers.1.attention.kv_cache.v_cache"
    spec = m["state"].pop(fqn)
    w = load_file(str(bad / "weights.safetensors"))
    w[fqn] = torch.zeros(spec["shape"])
    save_file(w, str(bad / "weights.safetensors"))
    m["weights"][fqn] = {"shape": spec["shape"], "dtype": spec["dtype"], "sha256": sha256(tensor_bytes(w[fqn]))}
    (bad / "manifest.json").write_text(json.dumps(m))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = onecopy.Engine.load(bad, max_sessions=8)
    assert any("capacity is 1" in str(c.message) for c in caught)
    with engine, onecopy.Engine.load(tiny_bundle) as good:
        assert engine.capacity() == 1
        assert any("capacity is 1" in n for n in engine.memory_report().notes)
        want = _solo(good, PROMPTS["A"])[0]
        with engine.open_session() as s:
            with pytest.raises(onecopy.SessionCapacityError, match="capacity is 1"):
                engine.open_session()
            assert list(s.generate_ids(PROMPTS["A"], GREEDY, stop_ids=[])) == want
        # The next session starts from clean state although the buffer lives in the store.
        with engine.open_session() as s:
            assert list(s.generate_ids(PROMPTS["A"], GREEDY, stop_ids=[])) == want
