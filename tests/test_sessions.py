"""Many isolated sessions on one loaded model."""

import json
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from safetensors.torch import save_file

import onecopy
from onecopy.runtime import method as method_mod

from .conftest import copy_bundle

GREEDY = onecopy.SamplingParams(max_new_tokens=12)
PROMPTS = {"A": [5, 9, 33, 2, 71, 8], "B": [100, 3], "C": [7, 7, 7, 250, 1, 19, 40, 41, 42, 43, 44]}


def _solo(engine, prompt, n=12):
    with engine.open_session() as s:
        ids = list(s.generate_ids(prompt, onecopy.SamplingParams(max_new_tokens=n), stop_ids=[]))
        return ids, {k: v.clone() for k, v in s.state.items()}


def test_interleaved_sessions_are_bit_identical_to_solo(det_engine):
    """Deterministic mode: consumed in turn (so batched together), each equals its solo run bit for bit."""
    solo = {k: _solo(det_engine, p) for k, p in PROMPTS.items()}
    sessions = {k: det_engine.open_session() for k in PROMPTS}
    streams = {k: sessions[k].generate_ids(p, GREEDY, stop_ids=[]) for k, p in PROMPTS.items()}
    got = {k: [] for k in PROMPTS}
    for _ in range(GREEDY.max_new_tokens):  # one token of each session in turn
        for k, it in streams.items():
            got[k].append(next(it))
    for k in PROMPTS:
        assert got[k] == solo[k][0], k
        for fqn, t in sessions[k].state.items():
            assert torch.equal(t, solo[k][1][fqn]), (k, fqn)


def test_batched_greedy_tokens_equal_solo_in_default_mode(tiny_engine):
    """Default mode runs each step at its own batch size: same greedy tokens on this well-separated model."""
    solo = {k: _solo(tiny_engine, p)[0] for k, p in PROMPTS.items()}
    steps = tiny_engine.scheduler.stats.decode_steps
    streams = {k: tiny_engine.submit(p, GREEDY, stop_ids=[]) for k, p in PROMPTS.items()}
    assert {k: s.result(timeout=120) for k, s in streams.items()} == solo
    # batched: about one step per token for all three together, not one per token per session
    assert tiny_engine.scheduler.stats.decode_steps - steps <= GREEDY.max_new_tokens + 2 * len(PROMPTS)


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


def test_methods_bind_weights_once_and_sessions_never_rebind(tiny_bundle, monkeypatch):
    """State is passed by row on every call: nothing is re-pointed when the session changes."""
    binds = []
    real = method_mod.Method.bind_weights
    monkeypatch.setattr(method_mod.Method, "bind_weights", lambda self, w: (binds.append(self.name), real(self, w))[1])
    with onecopy.Engine.load(tiny_bundle) as engine:
        assert sorted(binds) == ["decode", "prefill"]
        a, b = engine.open_session(), engine.open_session()
        tok = torch.tensor([3])
        a.prefill([1, 2, 3])
        b.decode(tok)
        a.decode(tok)
        list(b.generate_ids([4, 5], GREEDY))
        assert sorted(binds) == ["decode", "prefill"]


@pytest.fixture
def rows_engine(tiny_rows_bundle):
    with onecopy.Engine.load(tiny_rows_bundle) as engine:
        yield engine


def test_sessions_own_their_pool_row_and_it_is_counted_exactly(rows_engine):
    tiny_engine = rows_engine  # the row layout: a session's state is views of its row
    expected = sum(s.nbytes for s in tiny_engine.manifest.state.values())
    pool = tiny_engine.runner.pool
    a = tiny_engine.open_session()
    assert a.state_bytes == expected == sum(t.numel() * t.element_size() for t in a.state.values())
    assert all(t.abs().sum() == 0 for t in a.state.values())  # zeros before any run
    b = tiny_engine.open_session()
    assert (a.row, b.row) == (0, 1)
    for fqn, t in a.state.items():  # the session's state is exactly its row of the pool tensors
        assert t.data_ptr() == pool.tensors[fqn][a.row].data_ptr() and t.shape == pool.tensors[fqn].shape[1:]
    r = tiny_engine.memory_report()
    assert (r.sessions_open, r.state_bytes, r.state_bytes_per_session) == (2, 2 * expected, expected)
    assert r.pool_rows == tiny_engine.max_sessions == 8 and r.pool_bytes >= 9 * expected
    a.prefill([1, 2, 3])
    a.close()
    assert all(int(t[0].abs().sum()) == 0 for t in pool.tensors.values())  # zeroed when given back
    assert tiny_engine.memory_report().state_bytes == expected
    assert tiny_engine.open_session().row == 0  # the lowest free row is reused


def test_max_sessions_refusal_names_the_numbers(tiny_bundle):
    with onecopy.Engine.load(tiny_bundle, max_sessions=2) as e:
        assert e.capacity() == 2 and e.memory_report().pool_sizing.startswith("max_sessions=2; ")
        e.open_session()
        s = e.open_session()
        assert e.capacity() == 0
        with pytest.raises(onecopy.SessionCapacityError,
                           match=rf"all 2 rows of the state pool are in use \(max_sessions=2; .*; "
                                 rf"{e.state_bytes_per_session} bytes each\)"
                                 r".*Close a session, or load the engine with a larger max_sessions"):
            e.open_session()
        s.close()
        assert e.capacity() == 1
        e.open_session()


def test_memory_budget_sizes_the_pool(tiny_bundle):
    with onecopy.Engine.load(tiny_bundle, max_sessions=1) as e:
        # a session's state at max_seq_len, its rows of the sampler's tables and of the block table
        per = e.state_bytes_per_session + 3 * e.vocab_size + 8 * e.manifest.table_width
    with pytest.raises(onecopy.SessionCapacityError, match=rf"no session fits: one needs {2 * per} bytes .*memory_budget=1 bytes"):  # noqa: E501
        onecopy.Engine.load(tiny_bundle, memory_budget=1)
    with onecopy.Engine.load(tiny_bundle, memory_budget=int(3.5 * per)) as e:
        assert e.capacity() == 2 and "2 rows fit in memory_budget=" in e.memory_report().pool_sizing
    # paged KV: an explicit max_sessions is honoured with the blocks that fit (rows are cheap, blocks the capacity)
    with onecopy.Engine.load(tiny_bundle, memory_budget=int(3.5 * per), max_sessions=5) as e:
        width, blocks = e.manifest.table_width, e.scheduler.kv.blocks
        assert e.capacity() == 5 and 3 * width <= blocks < 4 * width
        assert e.memory_report().pool_sizing == (f"max_sessions=5; {blocks} KV blocks ({blocks * e.manifest.kv_block_size} "
                                                 "positions) fit in memory_budget=" f"{int(3.5 * per)} bytes: requests "
                                                 "wait for the blocks they need")
        # five requests that each write every position: three hold blocks at a time, the others wait, all finish
        ids = [[3 + i, 5, 7] for i in range(5)]
        n = e.max_seq_len - 3
        params = onecopy.SamplingParams(max_new_tokens=n)
        outs = [st.result(timeout=120) for st in [e.submit(p, params, stop_ids=[]) for p in ids]]
        assert [len(o) for o in outs] == [n] * 5
        fixed = per - width * e.runner.blocks.block_bytes  # a row's bytes outside the paged KV
        one_session = width * e.runner.blocks.block_bytes
    with pytest.raises(onecopy.SessionCapacityError, match=r"max_sessions=5 rows take .* fewer than one session at "
                                                           r"max_seq_len needs .*; ask for fewer sessions"):
        onecopy.Engine.load(tiny_bundle, memory_budget=6 * fixed + one_session, max_sessions=5)  # the scratch block
    with pytest.raises(onecopy.SessionCapacityError, match=r"max_sessions=5 and kv_blocks=40 need \d+ bytes of state "
                                                           r".* leaves \d+; ask for fewer sessions or blocks"):
        onecopy.Engine.load(tiny_bundle, memory_budget=int(3.5 * per), max_sessions=5, kv_blocks=40)


def test_pool_sizing_rules(monkeypatch):
    """CPU: 8 rows unless told; CUDA: a fraction of device memory, capped (like vLLM's gpu_memory_utilization)."""
    from onecopy.runtime import memory as engine_mod

    cpu = torch.device("cpu")
    assert engine_mod.size_pool(1000, cpu, max_sessions=None, memory_budget=None, memory_fraction=0.9, reserve=0)[0] == 8
    monkeypatch.setattr(engine_mod.torch.cuda, "mem_get_info", lambda d: (60 * 2**30, 80 * 2**30))
    gpu = torch.device("cuda", 0)
    rows, why = engine_mod.size_pool(2**30, gpu, max_sessions=None, memory_budget=None, memory_fraction=0.9, reserve=2**30)
    # 0.9 * 80 GiB - 20 GiB in use - 1 GiB reserve = 51 GiB: 51 rows of 1 GiB, one of them scratch
    assert rows == 50 and "0.90 of device memory" in why
    rows, why = engine_mod.size_pool(2**20, gpu, max_sessions=None, memory_budget=None, memory_fraction=0.9, reserve=0)
    assert rows == 256 and "capped at 256" in why


def test_closed_session_errors(tiny_engine):
    s = tiny_engine.open_session()
    s.close()
    s.close()  # idempotent
    for call in (lambda: s.prefill([1, 2]), lambda: s.run("decode", torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)),  # noqa: E501
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


def test_a_method_writing_a_constant_fails_closed(tiny_bundle, tmp_path):
    """A bundle whose methods write a constant in place (never one onecopy exports): sessions would
    share it, so capacity is 1 and every session starts from the constant's initial value."""
    bad = copy_bundle(tiny_bundle, tmp_path / "bad")
    m = json.loads((bad / "manifest.json").read_text())
    m["methods"]["decode"]["mutated_constants"] = ["norm.weight"]
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
            engine.weights.get("norm.weight").mul_(2.0)  # what an in-place write would leave behind
        with engine.open_session() as s:  # the next session starts from the constant's initial value
            assert list(s.generate_ids(PROMPTS["A"], GREEDY, stop_ids=[])) == want


def test_a_thousand_rows_share_the_blocks_that_fit_and_each_request_ends_as_alone(tiny_bundle):
    """Rows are cheap: 1024 rows and KV blocks for 256 short requests at a time. 1024 requests at once all finish,
    the later ones waiting for blocks, each with the tokens it gets alone (deterministic mode)."""
    with onecopy.Engine.load(tiny_bundle, max_sessions=1) as e:
        per = e.state_bytes_per_session + 3 * e.vocab_size + 8 * e.manifest.table_width
        bb = e.runner.blocks.block_bytes
    fixed = per - e.manifest.table_width * bb
    with onecopy.Engine.load(tiny_bundle, max_sessions=1024, memory_budget=1025 * fixed + 257 * bb,
                             deterministic=True, token_budget=1024) as e:  # many prompts' chunks per iteration
        assert e.capacity() == 1024 and e.scheduler.kv.blocks == 256
        prompts = [[11 + i, 7, 5] for i in range(8)]
        params = onecopy.SamplingParams(max_new_tokens=4)
        alone = [e.submit(p, params, stop_ids=[]).result(timeout=60) for p in prompts]
        streams = [e.submit(prompts[i % 8], params, stop_ids=[]) for i in range(1024)]
        got = [st.result(timeout=240) for st in streams]
        assert got == [alone[i % 8] for i in range(1024)]
        assert e.scheduler.stats.decode_rows / e.scheduler.stats.decode_steps > 64  # many rows per step
        assert e.capacity() == 1024 and e.scheduler.kv.usage()["free"] + e.scheduler.kv.usage()["cached"] == 256
