"""Isolation under concurrency: threads submit, cancel, close kept sessions mid-stream and open sessions
against a pool of three rows, in random order. Afterwards every row is free exactly once (and every KV
block), and every request that ended well gave exactly the tokens of its solo run, bit for bit
(deterministic mode: a session's tokens never depend on who shares its steps); a cancelled one gave a
prefix of them. A row handed out twice, a request lost between queues or a state row written by a
neighbour shows up as a difference here."""

from __future__ import annotations

import random
import threading

import pytest

import onecopy
from onecopy import SamplingParams, SessionCapacityError

ROWS, THREADS, OPS = 3, 4, 12
PROMPTS = [[5, 9, 33], [7, 8], list(range(3, 24)), [40, 41, 42, 43, 44], [60]]


def _params(rng: random.Random) -> SamplingParams:
    n = rng.randint(1, 14)
    if rng.random() < 0.5:
        return SamplingParams(max_new_tokens=n)
    return SamplingParams(max_new_tokens=n, temperature=1.0, top_k=rng.choice([0, 20]), seed=rng.randint(0, 1000))


def _read(stream, upto: int | None = None) -> list[int]:
    out = []
    for t in stream:
        out.append(t)
        if upto is not None and len(out) >= upto:
            break
    return out


class Workload:
    """What the threads did: (turns, ids, complete) per conversation, a turn being (kind, ids, params)
    with kind "prefill" (a direct call) or "submit"."""

    def __init__(self, engine: onecopy.Engine) -> None:
        self.engine = engine
        self.done: list[tuple[tuple, list[int], bool]] = []
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []

    def record(self, turns: list, ids: list[int], complete: bool) -> None:
        with self.lock:
            self.done.append((tuple(turns), ids, complete))

    def one(self, rng: random.Random) -> None:
        e, op = self.engine, rng.choice(["run", "cancel", "close-kept-midway", "two-turns", "open"])
        prompt, params = rng.choice(PROMPTS), _params(rng)
        turn = ("submit", tuple(prompt), params)
        if op == "run":
            stream = e.submit(prompt, params, stop_ids=[])
            self.record([turn], _read(stream), True)
        elif op == "cancel":
            stream = e.submit(prompt, params, stop_ids=[])
            _read(stream, rng.randint(0, 3))
            stream.cancel()
            self.record([turn], list(stream.ids), stream.finish_reason == "length")
        elif op == "close-kept-midway":  # the reported bug: the row went back twice
            stream = e.submit(prompt, params, stop_ids=[], keep_session=True)
            _read(stream, 1)
            stream.session.close()
            self.record([turn], list(stream.ids), stream.finish_reason == "length")
        elif op == "two-turns":
            stream = e.submit(prompt, params, stop_ids=[], keep_session=True)
            first = _read(stream)
            session = stream.session
            if stream.finish_reason != "length" or session.closed:
                return
            more, params2 = rng.choice(PROMPTS), _params(rng)
            second = _read(session.submit(more, params2, stop_ids=[]))
            session.close()
            self.record([turn, ("submit", tuple(more), params2)], first + second, True)
        else:
            try:
                session = e.open_session()
            except SessionCapacityError:
                return
            with session:
                session.prefill(prompt)
                more = rng.choice(PROMPTS)
                ids = _read(session.submit(more, params, stop_ids=[]))
            self.record([("prefill", tuple(prompt), None), ("submit", tuple(more), params)], ids, True)

    def thread(self, seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(OPS):
                self.one(rng)
        except BaseException as e:  # reported by the test, with its traceback
            self.errors.append(e)

    def solo(self, turns: tuple) -> list[int]:
        """The conversation alone on the (now idle) engine."""
        out = []
        with self.engine.open_session() as s:
            for kind, ids, params in turns:
                if kind == "prefill":
                    s.prefill(list(ids))
                else:
                    out += _read(s.submit(list(ids), params, stop_ids=[]))
        return out


def _stress(engine: onecopy.Engine, seed: int) -> Workload:
    work = Workload(engine)
    threads = [threading.Thread(target=work.thread, args=(seed * 100 + i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if work.errors:
        raise work.errors[0]
    return work


def _assert_everything_free(engine: onecopy.Engine) -> None:
    s = engine.scheduler
    assert (s.running, s.waiting, engine.sessions_open) == (0, 0, 0)
    assert s.rows.free_list() == list(range(ROWS)) and engine.capacity() == ROWS  # each row free, exactly once
    if s.kv is not None:
        use = s.kv.usage()
        assert use["references"] == 0 and use["shared"] == use["private"] == 0
        cached = [b for b in range(s.kv.blocks) if s.kv.index is not None and b in s.kv.index]
        assert sorted(s.kv.free_list() + cached) == list(range(s.kv.blocks))  # each block free or cached, once


@pytest.mark.timeout(600)
def test_concurrent_sessions_keep_their_rows_and_equal_their_solo_runs(tiny_bundle):
    with onecopy.Engine.load(tiny_bundle, max_sessions=ROWS, deterministic=True) as engine:
        work = _stress(engine, seed=1)
        _assert_everything_free(engine)
        assert len(work.done) > THREADS * OPS // 2
        solo: dict[tuple, list[int]] = {}
        for turns, ids, complete in work.done:
            if turns not in solo:
                solo[turns] = work.solo(turns)
            want = solo[turns]
            assert ids == (want if complete else want[:len(ids)]), f"{turns}: {ids} != solo {want}"
        _assert_everything_free(engine)


@pytest.mark.timeout(600)
def test_concurrent_sessions_on_shared_prefix_blocks_give_every_row_and_block_back(tiny_bundle):
    """The default mode, with the prefix cache on: sessions share and copy blocks while rows change hands."""
    with onecopy.Engine.load(tiny_bundle, max_sessions=ROWS, kv_blocks=ROWS * 4) as engine:
        assert engine.prefix_cache
        work = _stress(engine, seed=2)
        _assert_everything_free(engine)
        assert engine.scheduler.stats.cached_tokens > 0 and len(work.done) > THREADS * OPS // 2
