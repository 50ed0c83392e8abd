"""The scheduler: concurrent requests, batch invariance, joining and leaving, cancellation, admission, asyncio."""

import asyncio
import threading
import time

import pytest
import torch

import onecopy

GREEDY = onecopy.SamplingParams(max_new_tokens=12)
# Different prompt lengths (one longer than the prefill chunk) and sampling parameters.
REQUESTS = {
    "short": ([100, 3], GREEDY),
    "sampled": ([5, 9, 33, 2, 71, 8], onecopy.SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7,
                                                             max_new_tokens=14)),
    "long": ([7, 7, 7, 250, 1, 19, 40, 41, 42, 43, 44, 45, 46], onecopy.SamplingParams(max_new_tokens=10,
                                                                                         repetition_penalty=1.5)),
    "early": ([300, 301, 302], onecopy.SamplingParams(temperature=1.3, seed=3, max_new_tokens=3)),
    "late": ([11, 22, 33, 44], onecopy.SamplingParams(temperature=0.7, seed=99, max_new_tokens=12)),
}


@pytest.fixture
def det_chunked(tiny_bundle):
    """Deterministic, with prompts prefilled 5 tokens at a time (so prefill chunks interleave with decode)."""
    with onecopy.Engine.load(tiny_bundle, max_sessions=6, deterministic=True, prefill_chunk=5) as engine:
        yield engine


def _slow_decode(engine, monkeypatch, seconds=0.01):
    """Make each decode step take a while, so a test that acts mid-request is not outrun by the loop."""
    real = engine.runner.decode
    monkeypatch.setattr(engine.runner, "decode", lambda *a, **k: (time.sleep(seconds), real(*a, **k))[1])


def _run_alone(engine, prompt, params):
    with engine.open_session() as s:
        ids = s.submit(prompt, params, stop_ids=[]).result(timeout=120)
        return ids, {k: v.clone() for k, v in s.state.items()}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_concurrent_requests_equal_their_solo_runs_bit_for_bit(det_chunked, overlap, monkeypatch):
    """Deterministic mode, sessions joining and leaving mid-run: tokens and final state rows equal each run alone.
    Overlapped: each step is queued before the previous step's ids are read (the CUDA schedule)."""
    engine = det_chunked
    engine.loop.overlap = overlap
    solo = {k: _run_alone(engine, p, sp) for k, (p, sp) in REQUESTS.items()}
    cancelled_prompt = [60, 61, 62, 63]
    leaving_params = onecopy.SamplingParams(max_new_tokens=40)  # far more than the 4 read before it leaves
    cancelled_solo = _run_alone(engine, cancelled_prompt, leaving_params)[0]
    _slow_decode(engine, monkeypatch)  # the test reacts mid-run however fast the machine
    sessions = {k: engine.open_session() for k in REQUESTS}
    streams = {k: sessions[k].submit(*REQUESTS[k], stop_ids=[]) for k in ("short", "sampled", "long", "early")}
    leaving = engine.submit(cancelled_prompt, leaving_params, stop_ids=[])
    got_before_cancel = []
    for t in leaving:  # leaves after 4 tokens, mid-run
        got_before_cancel.append(t)
        if len(got_before_cancel) == 4:
            leaving.cancel()
            break
    for _ in streams["short"]:  # a session joins mid-run, once the others are decoding
        if len(streams["short"].ids) == 3:
            break
    streams["late"] = sessions["late"].submit(*REQUESTS["late"], stop_ids=[])
    for k, stream in streams.items():
        assert stream.result(timeout=120) == solo[k][0], k
        for fqn, t in sessions[k].state.items():
            assert torch.equal(t, solo[k][1][fqn]), (k, fqn)
    assert got_before_cancel == cancelled_solo[:4] and leaving.finish_reason == "cancelled"
    assert engine.scheduler.stats.prefill_chunks > len(REQUESTS)  # the long prompt went in several chunks


def test_overlapped_steps_stop_on_eos_with_the_right_state(tiny_bundle):
    """With overlap a request that meets a stop id has one more step queued: that step is dropped, the
    session's position is set back, and continuing the conversation gives what the unoverlapped run gives."""
    runs = []
    for overlap in (False, True):
        with onecopy.Engine.load(tiny_bundle, max_sessions=3) as engine, engine.open_session() as s:
            engine.loop.overlap = overlap
            free = s.submit([5, 9, 33], GREEDY, stop_ids=[]).result()
            s.reset()
            first = s.submit([5, 9, 33], GREEDY, stop_ids=[free[4]]).result()  # stops on its 5th token
            position = s.position
            more = s.submit([free[4], 40], GREEDY, stop_ids=[]).result()
            steps = engine.scheduler.stats.decode_steps
            runs.append((first, position, more, {k: v[:, :s.position].clone() for k, v in s.state.items()}, steps))
    (a, pa, ma, sa, na), (b, pb, mb, sb, nb) = runs
    assert a == b == free[:5] and pa == pb == 3 + 5 - 1 and ma == mb
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # every position in use holds the same
    assert nb == na + 1  # the one extra (dropped) step


def test_requests_from_many_threads(tiny_engine):
    prompts = [[i + 1, 2 * i + 3, 50 + i] for i in range(12)]  # more requests than the 8 rows: some wait
    want = [tiny_engine.submit(p, GREEDY, stop_ids=[]).result(timeout=120) for p in prompts]
    got, errors = [None] * len(prompts), []

    def work(i):
        try:
            got[i] = list(tiny_engine.submit(prompts[i], GREEDY, stop_ids=[]))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and got == want
    assert tiny_engine.capacity() == tiny_engine.max_sessions and tiny_engine.scheduler.running == 0


def test_async_streams(tiny_engine):
    prompts = [[4, 5, 6], [7, 8], [9, 10, 11, 12]]
    want = [tiny_engine.submit(p, GREEDY, stop_ids=[]).result(timeout=120) for p in prompts]

    async def consume(stream):
        return [t async for t in stream]

    async def main():
        return await asyncio.gather(*(consume(tiny_engine.submit(p, GREEDY, stop_ids=[])) for p in prompts))

    assert asyncio.run(main()) == want


def test_cancel_mid_stream_frees_the_row_at_once(tiny_bundle, monkeypatch):
    with onecopy.Engine.load(tiny_bundle, max_sessions=2) as engine:
        _slow_decode(engine, monkeypatch)
        stream = engine.submit([1, 2, 3], onecopy.SamplingParams(max_new_tokens=50), stop_ids=[])
        seen = []
        for t in stream:
            seen.append(t)
            if len(seen) == 3:
                assert engine.capacity() == 1
                stream.cancel()
                assert engine.capacity() == 2  # freed before cancel() returned
                break
        assert stream.finish_reason == "cancelled" and len(stream.ids) < 50
        # A generator dropped early cancels its request too.
        with engine.open_session() as s:
            gen = s.generate_ids([4, 5], onecopy.SamplingParams(max_new_tokens=50), stop_ids=[])
            next(gen)
            gen.close()
            assert s.stream is None
            assert list(s.generate_ids([6], onecopy.SamplingParams(max_new_tokens=2), stop_ids=[]))  # usable again
        assert engine.scheduler.running == 0 and engine.capacity() == 2


def test_admission_waits_in_the_queue_and_a_full_queue_raises(tiny_bundle):
    """Requests beyond the free rows wait (FIFO) until a row frees; beyond max_queue they are refused."""
    with onecopy.Engine.load(tiny_bundle, max_sessions=1, max_queue=1) as engine:
        holder = engine.open_session()  # takes the only row
        waiting = engine.submit([1, 2], GREEDY, stop_ids=[])
        time.sleep(0.2)
        assert not waiting.ids and engine.scheduler.waiting == 1
        with pytest.raises(onecopy.QueueFullError, match=r"1 requests already wait for a free row \(max_queue=1\); retry later"):
            engine.submit([3, 4], GREEDY)
        holder.close()  # the waiting request takes the row now
        assert len(waiting.result(timeout=60)) == GREEDY.max_new_tokens and waiting.finish_reason == "length"
        assert engine.capacity() == 1


def test_a_burst_that_fits_free_rows_plus_queue_is_accepted(tiny_bundle):
    """max_queue counts requests waiting for a row, not ones a free row takes at the next admission."""
    with onecopy.Engine.load(tiny_bundle, max_sessions=2, max_queue=1) as engine:
        with engine.lock:  # the loop cannot admit anything between these submits
            streams = [engine.submit([i + 1, 2], GREEDY, stop_ids=[]) for i in range(3)]  # 2 rows + 1 queued
            with pytest.raises(onecopy.QueueFullError, match=r"1 requests already wait for a free row \(max_queue=1\)"):
                engine.submit([9, 9], GREEDY)
        assert all(len(s.result(timeout=60)) == GREEDY.max_new_tokens for s in streams)


def test_decode_only_bundle_feeds_prompts_through_batched_decode(tiny_bundle, decode_only_export):
    """Without a prefill method, prompt tokens ride the batched decode step, one per iteration (the bundle: tiny-llama
    exported decode only, 32 positions, by the command line from an HF checkpoint: conftest.decode_only_export)."""
    out = decode_only_export.out
    assert decode_only_export.result.returncode == 0, decode_only_export.result.stderr
    with onecopy.Engine.load(out, max_sessions=4) as d, onecopy.Engine.load(tiny_bundle) as full:
        prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [42]]
        want = [full.submit(p, GREEDY, stop_ids=[]).result(timeout=60) for p in prompts]
        assert [s.result(timeout=60) for s in [d.submit(p, GREEDY, stop_ids=[]) for p in prompts]] == want


def test_unbatched_baseline_gives_the_same_tokens(tiny_bundle):
    """max_batch=1 steps one session at a time (today's interleaving, for benchmarks): same greedy tokens."""
    prompts = [[4, 5, 6], [7, 8], [9, 10, 11, 12]]
    with onecopy.Engine.load(tiny_bundle) as batched, onecopy.Engine.load(tiny_bundle, max_batch=1) as one:
        want = [s.result(timeout=60) for s in [batched.submit(p, GREEDY, stop_ids=[]) for p in prompts]]
        steps = one.scheduler.stats.decode_steps
        assert [s.result(timeout=60) for s in [one.submit(p, GREEDY, stop_ids=[]) for p in prompts]] == want
        assert one.scheduler.stats.decode_steps - steps == 3 * (GREEDY.max_new_tokens - 1)


def test_generate_and_run_use_the_scheduler(tiny_engine):
    before = tiny_engine.scheduler.stats.requests_submitted
    with tiny_engine.open_session() as s:
        text = "".join(t.text for t in s.generate(" hello", onecopy.SamplingParams(max_new_tokens=5), chat=False))
    assert text and tiny_engine.scheduler.stats.requests_submitted == before + 1


def test_bad_requests_are_refused_before_any_kernel_runs(tiny_engine, monkeypatch):
    calls = []
    for name in tiny_engine.methods:
        m = tiny_engine.method(name)
        monkeypatch.setattr(m, "_run", lambda args, _f=m._run: calls.append(1) or _f(args))
    with pytest.raises(onecopy.InputError, match=r"token id 512 at index 1 is outside the vocabulary \[0, 512\)"):
        tiny_engine.submit([5, 512, 7], GREEDY)
    with pytest.raises(onecopy.InputError, match=r"token id -1 at index 0 is outside the vocabulary"), \
            tiny_engine.open_session() as other:
        other.prefill([-1, 3])
    with pytest.raises(onecopy.InputError, match="prompt is empty"):
        tiny_engine.submit([], GREEDY)
    with pytest.raises(onecopy.PromptTooLongError, match=r"prompt of 65 tokens .* max_seq_len=64"):
        tiny_engine.submit(list(range(65)), GREEDY)
    s = tiny_engine.open_session()
    with pytest.raises(onecopy.InputError, match=r"decode input 'tokens' holds 600, outside \[0, 512\): token ids must "
                                                 r"lie in the vocabulary"):
        s.run("decode", torch.tensor([[600]]), torch.tensor([0]))
    with pytest.raises(onecopy.InputError, match=r"prefill input 'input_pos' holds 64, outside \[0, 64\): positions"):
        s.run("prefill", torch.tensor([[1, 2]]), torch.tensor([63, 64]))
    with pytest.raises(onecopy.InputError, match=r"decode on one session takes a batch of 1, got 2"):
        s.run("decode", torch.tensor([[1], [2]]), torch.tensor([0, 0]))
    assert calls == []
    with tiny_engine.lock:  # the loop cannot step (nor finish the request) while the test holds the lock
        running = s.submit([1, 2], onecopy.SamplingParams(max_new_tokens=60), stop_ids=[])
        with pytest.raises(onecopy.InputError, match=r"session \d+ already has a request running; wait for it"):
            s.submit([1, 2], GREEDY)
        with pytest.raises(onecopy.InputError, match=r"has a request running; wait for it or cancel it first"):
            s.prefill([1])
        running.cancel(wait=False)  # the loop finishes it "cancelled" before it could step
    s.close()  # waits for the cancellation, then gives the row back
    assert running.finish_reason == "cancelled" and tiny_engine.capacity() == tiny_engine.max_sessions


def test_closing_the_engine_ends_queued_and_running_requests(tiny_bundle, monkeypatch):
    engine = onecopy.Engine.load(tiny_bundle, max_sessions=2)
    _slow_decode(engine, monkeypatch)
    holder = engine.open_session()
    running = engine.submit([1, 2], onecopy.SamplingParams(max_new_tokens=50), stop_ids=[])
    for _ in running:  # it is generating
        break
    waiting = engine.submit([3, 4], GREEDY)  # both rows taken: it queues
    assert (engine.scheduler.running, engine.scheduler.waiting) == (1, 1)
    engine.close()
    for stream in (running, waiting):
        assert stream.finish_reason == "cancelled"
        with pytest.raises(onecopy.EngineClosedError, match="the engine was closed"):
            stream.result()
    assert 0 < len(running.ids) < 50 and not waiting.ids
    with pytest.raises(onecopy.EngineClosedError):
        engine.submit([1], GREEDY)
    assert holder.closed


def test_a_token_budget_gives_the_same_bits_in_fewer_steps(tiny_bundle):
    """Deterministic mode, every request submitted at once: with a token budget the prompts go in with
    fewer steps (several chunks per step, cut where one chunk per step cuts them), and every request's
    tokens and final state equal the one-chunk-per-step run's."""
    runs = {}
    for budget in (None, 40):
        with onecopy.Engine.load(tiny_bundle, max_sessions=6, deterministic=True, prefill_chunk=5,
                                 token_budget=budget) as engine:
            hold = threading.Event()
            has_work = engine.scheduler.has_work
            engine.scheduler.has_work = lambda: hold.is_set() and has_work()  # every request queued before step 1
            sessions = {k: engine.open_session() for k in REQUESTS}
            streams = {k: sessions[k].submit(p, sp, stop_ids=[]) for k, (p, sp) in REQUESTS.items()}
            hold.set()
            engine.loop.wake()
            ids = {k: s.result(timeout=120) for k, s in streams.items()}
            state = {k: {f: t.clone() for f, t in sessions[k].state.items()} for k in REQUESTS}
            runs[budget] = ids, state, engine.scheduler.stats
    (ids, state, stats), (ids_b, state_b, stats_b) = runs[None], runs[40]
    assert ids_b == ids
    for k in REQUESTS:
        for fqn, t in state[k].items():
            assert torch.equal(state_b[k][fqn], t), (k, fqn)
    assert stats_b.prefill_chunks == stats.prefill_chunks == 8  # the same cuts: 1 + 2 + 3 + 1 + 1 chunks of <= 5
    assert stats.prefill_steps == 8 and stats_b.prefill_steps < 8, stats_b.prefill_steps
