"""Blocks are the capacity: lazy KV blocks and preemption, as host policy (no bundle, no tensors) and on a
real bundle (a preempted request's stream equals its solo run, bit for bit in deterministic mode)."""


import pytest
import torch

import onecopy
from onecopy.params import SamplingParams
from onecopy.runtime.kv_manager import KVSpec
from onecopy.runtime.plan import ClearTable, SetTable, ZeroBlocks, ZeroRow
from onecopy.runtime.request import Request, RequestStatus
from onecopy.runtime.rows import RowLease
from onecopy.runtime.scheduler import Scheduler

from .conftest import PREEMPTING_PROMPTS, run_preempting, wait_until

BS = 4


def request(prompt, max_new_tokens=8, **kw) -> Request:
    return Request(0, list(prompt), SamplingParams(max_new_tokens=max_new_tokens, temperature=0.7), frozenset(), **kw)


def scheduler(blocks=4, **kw) -> Scheduler:
    """``new_token_ratio=0``: admit on the blocks needed now (requests preempt each other as they grow)."""
    kw.setdefault("new_token_ratio", 0.0)
    return Scheduler(3, max_seq_len=32, has_prefill=True, prefill_chunk=8, kv=KVSpec(blocks, 8, BS, False), **kw)


def two_running(**kw) -> tuple[Scheduler, Request, Request]:
    """a and b, 6-id prompts, prefilled and decoding; the four blocks all taken (a: 2, b: 2)."""
    s = scheduler(**kw)
    a, b = request(range(1, 7)), request(range(11, 17))
    s.add(a), s.add(b)
    assert s.admit() == [a, b]
    assert [len(s.kv.owned[r.row]) for r in (a, b)] == [2, 2]  # the prompt and the first new position: 7 of them
    s.update(s.schedule(), [100])  # a's prompt
    s.update(s.schedule(), [200, 101])  # b's prompt; a decodes at 6
    return s, a, b


def test_blocks_are_taken_as_rows_grow_and_the_newest_request_is_preempted_when_none_is_left():
    s, a, b = two_running()
    p = s.schedule()  # a at 7, b at 6: inside blocks they hold
    assert p.decode_positions == [7, 6] and p.state_ops == []
    s.update(p, [102, 201])
    p = s.schedule()  # a crosses into its third block; none is free: b, the newest, gives its two back
    b_blocks = (set(range(4)) - set(s.kv.owned[a.row][:2]))
    new = s.kv.owned[a.row][2]
    assert new in b_blocks and p.decode_rows == [a.row] and p.sampled == [a]
    assert p.state_ops == [ClearTable(b.row, 0), ZeroRow(b.row), ZeroBlocks((new,)), SetTable(a.row, 2, (new,))]
    assert (b.status, b.resumed, b.position, b.preemptions, s.stats.preemptions) == (RequestStatus.WAITING, 2, 0, 1, 1)
    assert s.rows.holds(b.lease) and s.waiting == 1 and s.kv.owned[b.row] == []  # it keeps its row, not its blocks
    s.update(p, [103])
    # b needs 3 blocks back (8 ids and its next position) and 1 is free: it waits while a runs to its end.
    while a.status is not RequestStatus.FINISHED:
        assert s.admit() == [] and b.status is RequestStatus.WAITING
        p = s.schedule()
        s.update(p, [104 + len(a.output)] * len(p.sample))
    assert s.admit() == []  # admitted again: not a new admission
    p = s.schedule()
    start = p.starts[0]
    assert (start.row, start.seen, start.seed) == (b.row, [*range(11, 17), 200, 201], b.seed)
    # Its prompt and the ids it streamed, prefilled at once; it samples its third id at position 8.
    assert (p.prefill.request, p.prefill.start, p.prefill.tokens) == (b, 0, [*range(11, 17), 200, 201])
    assert p.sample == [(b, -1)] and p.sample_positions == [8] and p.sample_first == [False]
    assert s.stats.recomputed_tokens == 8 and s.stats.prompt_tokens == 12
    s.update(p, [202])
    assert b.output == [200, 201, 202]


def test_a_request_with_an_id_on_its_way_is_drained_for_a_step_before_it_is_preempted():
    """Overlapped steps: the step that needs b's blocks is planned before the previous step's ids are back.
    b and the row short of a block sit it out; b is preempted at the next step with every id it sampled."""
    s, a, b = two_running()
    queued = s.schedule()  # a at 7, b at 6; their ids are not back yet
    p = s.schedule()
    assert p is None or (p.decode_rows == [] and p.state_ops == [])  # nobody could run
    assert b.status is RequestStatus.DECODING and a.position == 8
    s.update(queued, [102, 201])
    p = s.schedule()
    assert b.status is RequestStatus.WAITING and b.resumed == 2 and b.output == [200, 201]
    assert p.decode_rows == [a.row] and p.decode_positions == [8]


def test_a_deterministic_engine_replays_the_streamed_ids_through_the_decode_step():
    s, a, b = two_running(replay_in_decode=True)
    s.update(s.schedule(), [102, 201])
    s.update(s.schedule(), [103])  # b preempted
    s.finish(a, "cancelled")
    s.admit()
    p = s.schedule()  # the prompt alone is prefilled (cut as it was first), not sampled
    assert p.prefill.tokens == list(range(11, 17)) and p.sample == [] and p.decode_rows == []
    p = s.schedule()  # then 200 at 6, as the decode step first wrote it
    assert p.decode_rows == [b.row] and p.decode_positions == [6] and p.fed == [(b.row, 200)] and p.sample == []
    p = s.schedule()  # and 201 at 7, sampled: the id after it
    assert p.decode_positions == [7] and p.fed == [(b.row, 201)] and p.sample == [(b, 0)] and p.sample_positions == [8]
    assert p.sample_first == [False]


def test_a_request_continuing_a_session_reserves_its_span_and_is_never_preempted():
    s = scheduler(blocks=5)
    s.kv.prepare(2, 0, 4)  # the session's row holds its first turn: one block
    turn = request(range(21, 24), max_new_tokens=6, lease=RowLease(2, 0), owns_row=False, start=4,
                   base=[1, 2, 3, 4])
    assert not s.kv.grows(turn) and s.kv.admission_end(turn) == 4 + 3 + 5
    fresh = request(range(1, 7), max_new_tokens=14)
    s.add(turn), s.add(fresh)
    s.admit()
    assert len(s.kv.owned[2]) == 3 and len(s.kv.owned[fresh.row]) == 2  # all it may write / what it reads
    ids = iter(range(300, 400))
    while fresh.preemptions == 0:
        p = s.schedule()
        s.update(p, [next(ids) for _ in p.sample])
    # fresh crossed into a block with none left: with nothing else that grows, it gave its own back, and it
    # waits for every block it may write (resumed on fewer, it would give them back at once, again and again).
    assert turn.status is RequestStatus.DECODING and len(s.kv.owned[2]) == 3 and s.kv.owned[fresh.row] == []
    assert fresh.reserve and s.kv.admission_end(fresh) == 6 + 13
    while turn.status is not RequestStatus.FINISHED:
        assert s.admit() == [] and fresh.status is RequestStatus.WAITING
        p = s.schedule()
        s.update(p, [next(ids) for _ in p.sample])
    s.kv.release(2)  # the session closes: fresh runs again on its blocks
    while fresh.status is not RequestStatus.FINISHED:
        s.admit()
        p = s.schedule()
        s.update(p, [next(ids) for _ in p.sample])
    assert turn.finish_reason == fresh.finish_reason == "length" and len(fresh.output) == 14 and fresh.preemptions == 1


def test_a_request_that_ends_on_the_id_it_was_drained_for_keeps_its_row_whole():
    """A kept request whose id in flight is a stop id ends while drained, its row as it was: the session holds
    its conversation (a row emptied under it would have left the session open and empty)."""
    s, a, b = two_running()
    b.stop_ids, b.keep_row = frozenset({201}), True
    queued = s.schedule()
    s.schedule()  # b drained
    s.update(queued, [102, 201])
    assert b.finish_reason == "stop" and b.preemptions == 0 and b.end == 7 and b.held == [*range(11, 17), 200]
    assert s.rows.holds(b.lease) and len(s.kv.owned[b.row]) == 2  # kept, with its blocks
    p = s.schedule()  # b's blocks stay with its session: a has none to grow into and gives its own back
    assert a.status is RequestStatus.WAITING and a.reserve and p.decode_rows == []


class IdleSessions:
    """A reclaimer holding idle sessions' rows (as the server's conversation cache does)."""

    def __init__(self, s: Scheduler, leases: list) -> None:
        self.s, self.leases, self.reclaimed = s, leases, 0

    def idle(self) -> int:
        return len(self.leases)

    def reclaim(self) -> bool:
        if not self.leases:
            return False
        self.s.free_row(self.leases.pop(0))
        self.reclaimed += 1
        return True


def test_idle_sessions_give_their_blocks_back_before_a_running_request_is_preempted():
    s = scheduler(blocks=6)
    lease = s.take_row()
    s.kv.prepare(lease.row, 0, 8)  # an idle conversation holds 2 blocks
    s.reclaimer = idle = IdleSessions(s, [lease])
    a, b = request(range(1, 7)), request(range(11, 17))
    s.add(a), s.add(b)
    s.admit()
    ids = iter(range(300, 400))
    while a.position < 9:
        p = s.schedule()
        s.update(p, [next(ids) for _ in p.sample])
    assert idle.reclaimed == 1 and s.stats.preemptions == 0 and not s.rows.holds(lease)


def test_a_request_waiting_for_blocks_holds_back_the_later_ones_and_the_loop_rests():
    """has_work follows admission's rule: with the oldest request short of blocks, a later one that would fit
    is not admitted, so has_work says there is nothing to do (the loop sleeps instead of spinning)."""
    s = scheduler(blocks=4)
    lease = s.take_row()
    s.kv.prepare(lease.row, 0, 12)  # a session holds 3 of the 4 blocks
    big, small = request(range(1, 9)), request(range(11, 13))
    s.add(big), s.add(small)
    assert s.admit() == [] and not s.has_work()
    s.free_row(lease)
    assert s.has_work() and s.admit() == [big, small]


# -- on a real bundle ---------------------------------------------------------------------------------------------

def _solo(bundle, prompt, params, **load) -> tuple[list[int], dict[str, torch.Tensor]]:
    with onecopy.Engine.load(bundle, **load) as engine:
        stream = engine.submit(prompt, params, chat=False, stop_ids=[], keep_session=True)
        ids = stream.result()
        state = {k: v.clone() for k, v in stream.session.state.items()}
        return list(ids), state


@pytest.mark.parametrize("deterministic,overlap", [(True, False), (False, True)])
def test_requests_preempted_for_blocks_equal_their_solo_runs(tiny_bundle, deterministic, overlap):
    """Six requests whose prompts and outputs need 4 blocks each share 10 blocks: rows grow into each other's
    and the newest are preempted and resumed, again and again. None fails; in deterministic mode each
    one's ids and its row's final state (KV and all) equal its run alone, bit for bit (the streamed ids go
    back through the decode step: prefilled again, the KV of 4 of the 6 differed). With overlapped steps
    (CUDA's default) a preempted request still gets the ids of the steps queued before."""
    params = [SamplingParams(max_new_tokens=30, temperature=0.8, top_k=40, seed=i) for i in range(6)]
    runs = run_preempting(tiny_bundle, params, deterministic=deterministic, overlap=overlap)
    assert all(len(ids) == 30 for ids in runs.ids)
    assert runs.preemptions >= 3 and runs.references == 0
    if not deterministic:
        return  # recomputed by the prefill: the same ids up to rounding, not bit for bit
    for prompt, q, ids, state in zip(PREEMPTING_PROMPTS, params, runs.ids, runs.states):
        want_ids, want_state = _solo(tiny_bundle, prompt, q, max_sessions=1, deterministic=True)
        assert ids == want_ids
        for k in want_state:
            assert torch.equal(state[k], want_state[k]), k


def test_the_server_counts_preemptions_and_every_request_completes(tiny_bundle):
    """Six completions at once through the official client on 10 blocks: preempted ones still return every token;
    /metrics and the memory report count the preemptions and the blocks used."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import openai

    from onecopy.serve import BackgroundServer, ServerConfig

    with onecopy.Engine.load(tiny_bundle, max_sessions=6, kv_blocks=10, new_token_ratio=0.0) as engine, \
            BackgroundServer(engine, ServerConfig(model_name="tiny")) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def complete(i: int) -> int:
            prompt = [3 + (7 * i + j) % 200 for j in range(20 + i)]
            out = c.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0.8, seed=i,
                                       extra_body={"ignore_eos": True})
            return out.usage.completion_tokens

        with ThreadPoolExecutor(6) as pool:
            with engine.lock:  # the engine steps once all six are queued: they preempt each other on any machine
                done = [pool.submit(complete, i) for i in range(6)]
                assert wait_until(lambda: engine.scheduler.waiting == 6, timeout=30)
            assert [f.result() for f in done] == [30] * 6
        stats = engine.scheduler.stats
        assert stats.preemptions > 0
        text = httpx.get(server.url + "/metrics").text
        assert f"onecopy_preemptions_total {float(stats.preemptions)}" in text
        assert f"onecopy_recomputed_tokens_total {float(stats.recomputed_tokens)}" in text
        report = engine.memory_report()
        assert report.preemptions == stats.preemptions and report.kv_peak_used_blocks == 10
        assert f"{stats.preemptions} ({stats.recomputed_tokens})" in str(report)



def test_with_a_new_token_ratio_of_one_admission_keeps_every_running_requests_span_free():
    """The default: a request is admitted only when the running ones can all reach max_new_tokens beside it,
    so none is preempted (TensorRT-LLM's GUARANTEED_NO_EVICT); its blocks are still taken as it grows."""
    s = scheduler(new_token_ratio=1.0)
    a, b = request(range(1, 7)), request(range(11, 17))  # 4 blocks each at max_new_tokens, 4 in all
    s.add(a), s.add(b)
    assert s.admit() == [a] and len(s.kv.owned[a.row]) == 2  # b would leave a short of its span
    ids = iter(range(300, 400))
    while a.status is not RequestStatus.FINISHED:
        assert s.admit() == []
        p = s.schedule()
        s.update(p, [next(ids) for _ in p.sample])
    assert s.admit() == [b] and s.stats.preemptions == 0
