"""Batched prefill: a step's equal-length prompt chunks go through one prefill call (tokens [N, T], each chunk
on its own row at its own start), and each request comes out as it does with one call per chunk."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import onecopy
from onecopy.runtime.plan import PrefillChunk
from onecopy.runtime.runner import PREFILL_CALL_TOKENS, takes_chunks

from .bundle_cache import cached_bundle
from .conftest import TINY_MAX_SEQ_LEN

# Four prompts, prefill_chunk 5 and a budget of 40: step 1 cuts a, b, c to 5 tokens each (one call of three) and
# d's 3 (a call of its own); step 2 gives a's and b's rests (2 each, at position 5: one call) and c's second 5.
PROMPTS = {"a": [5, 6, 7, 8, 9, 10, 11], "b": [11, 12, 13, 14, 15, 16, 17],
           "c": [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32], "d": [40, 41, 42]}
GREEDY = onecopy.SamplingParams(max_new_tokens=6, temperature=0)


def run_all(bundle: Path, *, batched: bool, **load) -> tuple[dict, dict, list[list[tuple[int, int, int]]]]:
    """Every prompt submitted before the first step; each request's ids and final state, and the prefill
    calls made: (row, start, length) of each call's chunks."""
    with onecopy.Engine.load(bundle, max_sessions=6, prefill_chunk=5, token_budget=40, **load) as engine:
        runner = engine.runner
        assert runner.batched_prefill  # the tiny Llama's prefill takes chunks of several sessions
        runner.batched_prefill = batched
        calls: list[list[tuple[int, int, int]]] = []
        prefill_chunks = runner.prefill_chunks
        runner.prefill_chunks = lambda chunks: calls.append([(c.row, c.start, len(c.tokens)) for c in chunks]) \
            or prefill_chunks(chunks)
        hold = threading.Event()
        has_work = engine.scheduler.has_work
        engine.scheduler.has_work = lambda: hold.is_set() and has_work()  # every request queued before step 1
        sessions = {k: engine.open_session() for k in PROMPTS}
        streams = {k: sessions[k].submit(p, GREEDY, stop_ids=[]) for k, p in PROMPTS.items()}
        hold.set()
        engine.loop.wake()
        ids = {k: s.result(timeout=120) for k, s in streams.items()}
        state = {k: {f: t.clone() for f, t in sessions[k].state.items()} for k in PROMPTS}
    return ids, state, calls


@pytest.fixture(scope="module", params=["paged", "rows", "int8"])
def bundle(request, tiny_bundle, tiny_rows_bundle) -> Path:
    if request.param == "int8":
        return cached_bundle("tiny-llama", max_seq_len=TINY_MAX_SEQ_LEN, kv_dtype="int8")  # test_kv_dtype's bundle
    return {"paged": tiny_bundle, "rows": tiny_rows_bundle}[request.param]


def test_equal_length_chunks_go_in_one_call_and_give_what_one_call_per_chunk_gives(bundle):
    """Paged KV, a row per session, an 8-bit cache: the step's chunks of one length are one call, and every
    request's tokens and state equal those of the same schedule run one call per chunk (the state to float
    rounding, the GEMMs seeing more rows; an 8-bit value to one step of its quantization)."""
    ids, state, calls = run_all(bundle, batched=True)
    ids_1, state_1, calls_1 = run_all(bundle, batched=False)
    assert calls[:3] == [[(0, 0, 5), (1, 0, 5), (2, 0, 5)], [(3, 0, 3)], [(0, 5, 2), (1, 5, 2)]], calls
    assert sorted(c for call in calls for c in call) == sorted(c for call in calls_1 for c in call)  # same chunks
    assert all(len(call) == 1 for call in calls_1) and len(calls) < len(calls_1)
    assert ids == ids_1
    for k in PROMPTS:
        assert len(ids[k]) == GREEDY.max_new_tokens
        for fqn, t in state_1[k].items():
            atol = 1e-4 if t.is_floating_point() and t.element_size() > 1 else 1
            torch.testing.assert_close(state[k][fqn].float(), t.float(), atol=atol, rtol=1e-4, msg=(k, fqn))


def test_a_batched_call_equals_the_eager_model_on_each_chunk(tiny_bundle, tiny_source):
    """The logits of one call for two sessions' 3-token chunks at different starts (positions 3.. and 2..) are
    the eager model's for each session."""
    model = tiny_source.build(TINY_MAX_SEQ_LEN, torch.float32)
    prompts, cuts = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13]], [3, 2]
    ref = []
    with torch.no_grad():
        for p, cut in zip(prompts, cuts):
            model._eager_state = None  # a fresh session
            model(torch.tensor([p[:cut]]), torch.arange(cut))
            ref.append(model(torch.tensor([p[cut:]]), torch.arange(cut, len(p))))
    with onecopy.Engine.load(tiny_bundle, max_sessions=2) as engine:
        sessions = [engine.open_session() for _ in prompts]
        for s, p in zip(sessions, prompts):
            s.prefill(p)  # its blocks; the batched call writes the chunk's positions again, with the same values
        with engine.lock:
            out = engine.runner.prefill_chunks([PrefillChunk(None, s.row, cut, p[cut:])
                                                for s, p, cut in zip(sessions, prompts, cuts)])
    torch.testing.assert_close(out, torch.cat(ref), atol=1e-4, rtol=1e-4)


def test_deterministic_mode_keeps_a_call_per_chunk_and_a_call_takes_at_most_8192_tokens(tiny_bundle, det_engine):
    """Deterministic mode: a chunk's bits must not depend on the chunks beside it, so each is its own call.
    Batched calls group the chunks of one length, at most PREFILL_CALL_TOKENS tokens a call (the activations'
    memory is bounded whatever the token budget)."""
    assert not det_engine.runner.batched_prefill
    with onecopy.Engine.load(tiny_bundle, max_sessions=2) as engine:
        assert engine.runner.batched_prefill and takes_chunks(engine.method("prefill"))
        chunks = [type("C", (), {"tokens": t})() for t in ([1, 2], [3], [4, 5], [6])]
        assert engine.runner.prefill_groups(chunks) == [[0, 2], [1, 3]]
        big = [type("C", (), {"tokens": [1] * 3000})() for _ in range(5)]  # 15000 tokens: calls of two chunks (6000)
        assert PREFILL_CALL_TOKENS == 8192 and engine.runner.prefill_groups(big) == [[0, 1], [2, 3], [4]]
        engine.runner.batched_prefill = False
        assert engine.runner.prefill_groups(chunks) == [[0], [1], [2], [3]]


def test_a_direct_prefill_takes_one_session_and_its_positions_as_before(tiny_engine):
    """session.run("prefill") keeps its one-session form (positions [T]); chunks of several sessions are the
    scheduler's: a direct call with two is refused by name."""
    s = tiny_engine.open_session()
    out = s.run("prefill", torch.tensor([[1, 2, 3]]), torch.arange(3))
    assert out.shape == (1, tiny_engine.vocab_size)
    with pytest.raises(onecopy.InputError, match=r"prefill on one session takes a batch of 1, got 2; batches of "
                                                 r"sessions go through the scheduler"):
        s.run("prefill", torch.tensor([[1, 2], [3, 4]]), torch.tensor([[3, 4], [3, 4]]))
