"""The state pool: rows owned by sessions, padding confined to the scratch row, no per-step row copies."""

import re
import zipfile

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import onecopy

GREEDY = onecopy.SamplingParams(max_new_tokens=20)
CANARY = 7.25


def test_padded_steps_touch_only_their_own_rows(tiny_bundle):
    """Canary: free rows and the scratch row hold a pattern; after many padded batched steps (every step
    padded to the full pool with the scratch row), free rows are untouched, the scratch row was written
    by the padding and the live rows by their sessions."""
    with onecopy.Engine.load(tiny_bundle, max_sessions=6, decode_buckets=[6]) as engine:
        prompts = {"a": [5, 9, 33], "b": [100, 3, 4, 5, 6, 7]}
        sessions = {k: engine.open_session() for k in prompts}
        pool = engine.runner.pool
        live = {s.row for s in sessions.values()}
        free = [r for r in range(pool.rows + 1) if r not in live]  # the free rows and the scratch row
        assert pool.scratch in free and len(free) == pool.rows + 1 - len(live)
        for t in pool.tensors.values():
            t[free] = CANARY
        steps = engine.scheduler.stats.decode_steps
        streams = {k: sessions[k].submit(p, GREEDY, stop_ids=[]) for k, p in prompts.items()}
        for st in streams.values():
            st.result(timeout=60)
        assert engine.scheduler.stats.decode_steps - steps >= GREEDY.max_new_tokens - 1
        for fqn, t in pool.tensors.items():
            for r in free:
                if r != pool.scratch:
                    assert bool((t[r] == CANARY).all()), (fqn, r)  # never written
            assert not bool((t[pool.scratch] == CANARY).all()), fqn  # padding did write here
            for k, s in sessions.items():
                assert bool(t[s.row].abs().sum() > 0), (fqn, k)  # the session's steps wrote its own row


def test_chunked_prefill_equals_one_shot_prefill(tiny_bundle):
    prompt = [7, 3, 99, 250, 18, 42, 5, 300, 11, 4, 8, 15, 16, 23]
    with onecopy.Engine.load(tiny_bundle) as whole, onecopy.Engine.load(tiny_bundle, prefill_chunk=4) as chunked:
        assert chunked.scheduler.prefill_chunk == 4
        a, b = whole.open_session(), chunked.open_session()
        la, lb = a.prefill(prompt), b.prefill(prompt)  # one call of 14 tokens vs 4 + 4 + 4 + 2
        torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
        for fqn, t in a.state.items():
            torch.testing.assert_close(b.state[fqn], t, rtol=1e-5, atol=1e-5)
        assert a.position == b.position == len(prompt)
        a.reset(), b.reset()
        assert list(a.generate_ids(prompt, GREEDY, stop_ids=[])) == list(b.generate_ids(prompt, GREEDY, stop_ids=[]))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_opening_and_closing_sessions_allocates_nothing(tiny_engine):
    """The pool is allocated at load: a session only takes and zeroes a row of it."""
    buffer = tiny_engine.runner.pool.buffer.data_ptr()
    with _Ops() as ops:
        for _ in range(3):
            sessions = [tiny_engine.open_session() for _ in range(tiny_engine.max_sessions)]
            for s in sessions:
                s.close()
    factories = [o for o in ops.ops if re.search(r"\.(empty|zeros|ones|full|new_|clone)", o)]
    assert not factories, factories
    assert {o.split(".")[1] for o in ops.ops} <= {"_foreach_zero_", "select", "zero_"}
    assert tiny_engine.runner.pool.buffer.data_ptr() == buffer


def _wrapper_source(package):
    with zipfile.ZipFile(package) as z:
        return next(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.cpp"))


@pytest.mark.parametrize("layout", ["blocks", "rows"])
def test_decode_never_materialises_a_gather_of_cache_rows(tiny_bundle, tiny_rows_bundle, layout):
    """Every buffer the compiled decode allocates is small: none holds a session's K or V for a layer
    (heads x positions x head_dim), i.e. no copy of the sessions' cache is made, paged or in rows (the
    gather is fused into the attention reductions, which read the pool in place)."""
    import json

    bundle = tiny_bundle if layout == "blocks" else tiny_rows_bundle
    m = json.loads((bundle / "manifest.json").read_text())
    heads, positions, head_dim = m["state"]["layers.0.attention.k_cache"]["shape"]  # a row's, or a block's
    if m.get("kv_block_size"):
        positions = -(-(m["max_seq_len"] + 1) // m["kv_block_size"]) * m["kv_block_size"]
    src = _wrapper_source(bundle / "methods" / "decode.pt2")
    arrays = dict(re.findall(r"int_array_(\d+)\[\] = \{([^}]*)\}", src))
    sizes = [arrays[a] for a in re.findall(r"aoti_torch_empty_strided\(\d+, int_array_(\d+),", src)]
    assert sizes, "no allocations found: the wrapper format changed"
    for size in sizes:
        static = 1
        for d in (d.strip() for d in size.split(",") if d.strip()):
            static *= int(d[:-1]) if d.endswith("L") and d[:-1].isdigit() else 1
        assert static < heads * positions * head_dim, size


def test_pool_row_views_are_the_state(tiny_rows_bundle):
    with onecopy.Engine.load(tiny_rows_bundle) as tiny_engine, tiny_engine.open_session() as s:
        s.prefill([1, 2, 3])
        row = s.row
        for fqn, t in s.state.items():
            pool_t = tiny_engine.runner.pool.tensors[fqn]
            assert t.data_ptr() == pool_t[row].data_ptr()
            assert bool(pool_t[row, :, :3].abs().sum() > 0) and bool(pool_t[row, :, 3:].abs().sum() == 0)
    with pytest.raises(onecopy.SessionClosedError):
        s.state


def test_default_decode_buckets_double_to_128_then_step_by_a_quarter_and_an_eighth():
    """Padding is nearly free while a step reads its weights (few rows) and costs in proportion once its GEMMs are
    compute-bound (hundreds of rows): doublings to 128, then steps of 32 to 512 and 64 past it; the pool size last."""
    from onecopy.runtime.step import default_buckets

    assert default_buckets(1) == [1] and default_buckets(6) == [1, 2, 4, 6]
    assert default_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 224, 256]
    got = default_buckets(1000)
    assert got[:12] == default_buckets(256) and got[-1] == 1000 and len(got) == 28
    assert got[11:20] == list(range(256, 513, 32)) and got[19:27] == list(range(512, 961, 64))
    assert max(b / a for a, b in zip(got[7:], got[8:])) <= 1.25  # past 128 rows a step pads by at most a quarter
