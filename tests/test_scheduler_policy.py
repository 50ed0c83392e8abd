"""The scheduler as pure policy: plans, rows and bookkeeping on the host, no bundle, no tensors."""

import collections
import threading

import pytest

from onecopy.errors import InputError, QueueFullError
from onecopy.params import SamplingParams
from onecopy.runtime.plan import ZeroRow
from onecopy.runtime.request import Request, RequestStatus
from onecopy.runtime.rows import RowAllocator, RowLease
from onecopy.runtime.scheduler import Scheduler


def request(prompt, max_new_tokens=4, stop=(), row: int | None = None, keep=False) -> Request:
    """A request on a row of its own, or (``row``) on a session's row."""
    return Request(0, list(prompt), SamplingParams(max_new_tokens=max_new_tokens), frozenset(stop), keep_row=keep,
                   lease=RowLease(row, 0) if row is not None else None, owns_row=row is None)


def scheduler(rows=2, chunk=4, **kw) -> Scheduler:
    return Scheduler(rows, max_seq_len=64, has_prefill=kw.pop("has_prefill", True), prefill_chunk=chunk, **kw)


def test_requests_wait_for_rows_in_order_and_own_sessions_go_ahead():
    s = scheduler(rows=1)
    a, b = request([1, 2]), request([3])
    mine = request([4], row=7)
    for r in (a, b, mine):
        s.add(r)
    assert s.admit() == [a, mine]  # b waits for a row; the request on its own session does not
    assert (a.row, a.status, b.status) == (0, RequestStatus.PREFILLING, RequestStatus.WAITING)
    assert (s.waiting, s.running) == (1, 2)


def test_admission_with_every_row_taken_looks_at_one_request_not_the_whole_queue():
    """TensorRT-LLM's points queue 30000 requests at once: an admission that finds no free row stops at the first
    request needing one (rows free only as requests end), instead of weighing each of the thousands behind it
    every step (3.3 s a step on this host before)."""
    s = scheduler(rows=2)
    queued = [request([1, 2]) for _ in range(3000)]
    for r in queued:
        s.add(r)
    weighed = []
    fits = s._fits
    s._fits = lambda req, promised: weighed.append(req) or fits(req, promised)
    assert s.admit() == queued[:2] and weighed == queued[:3]  # the third found no row; nobody behind it was weighed
    weighed.clear()
    assert s.admit() == [] and weighed == [queued[2]] and s.waiting == 2998
    mine = request([4], row=7)  # a request on its session's row still goes ahead of the queue
    s.add(mine)
    assert s.admit() == [mine] and s.waiting == 2998


def test_finishing_everything_ends_a_long_queue_without_searching_it_per_request():
    class Counting(collections.deque):
        scanned = 0  # entries a membership test walks past

        def __contains__(self, item):
            Counting.scanned += len(self)
            return super().__contains__(item)

    s = scheduler(rows=1)
    queued = [request([1]) for _ in range(2000)]
    for r in queued:
        s.add(r)
    s.admit()
    s._waiting = Counting(s._waiting)
    s.finish_all("cancelled")
    assert Counting.scanned == 0 and s.waiting == 0 and s.running == 0
    assert all(r.finish_reason == "cancelled" for r in queued) and len(s.take_finished()) == 2000


def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_others_decode():
    s = scheduler(rows=2, chunk=4)
    short, long = request([1, 2]), request(list(range(10, 20)))
    s.add(short), s.add(long)
    s.admit()
    p1 = s.schedule()  # short's whole prompt; nothing decodes yet
    assert (p1.prefill.request, p1.prefill.start, p1.prefill.tokens) == (short, 0, [1, 2])
    assert p1.sample == [(short, -1)] and p1.sample_positions == [2] and p1.sample_first == [True]
    s.update(p1, [50])
    p2 = s.schedule()  # long's first chunk, and short decodes its first sampled token at position 2
    assert (p2.prefill.request, p2.prefill.start, p2.prefill.tokens) == (long, 0, [10, 11, 12, 13])
    assert p2.decode_rows == [short.row] and p2.decode_positions == [2] and p2.fed == []
    assert p2.sample == [(short, 0)] and p2.sample_positions == [3] and p2.sample_first == [False]
    p3 = s.schedule()
    assert p3.prefill.tokens == [14, 15, 16, 17] and p3.prefill.start == 4 and p3.decode_positions == [3]
    p4 = s.schedule()  # long's last chunk: its logits are sampled, first
    assert p4.prefill.tokens == [18, 19] and p4.sample == [(long, -1), (short, 0)] and p4.sample_first == [True, False]
    assert s.stats.prefill_chunks == 4 and s.stats.decode_steps == 3


def test_ids_stream_and_stop_rules_finish_requests():
    s = scheduler(rows=3)
    stops, runs_out = request([1], max_new_tokens=10, stop=[99]), request([2], max_new_tokens=2)
    s.add(stops), s.add(runs_out)
    s.admit()
    plans = [s.schedule() for _ in range(2)]
    assert s.update(plans[0], [5]) == [(stops, 5)]  # only stops was prefilled in the first step
    assert plans[1].sampled == [runs_out, stops]  # the prefilled request's logits come first
    assert s.update(plans[1], [6, 99]) == [(runs_out, 6), (stops, 99)]
    assert stops.finish_reason == "stop" and runs_out.status is RequestStatus.DECODING
    p = s.schedule()
    assert p.sample == [(runs_out, 0)] and runs_out.exhausted  # its last token is launched
    s.update(p, [7])
    assert runs_out.finish_reason == "length" and s.take_finished() == [stops, runs_out] and s.running == 0


def test_an_extra_step_after_a_stop_id_is_dropped_and_its_position_undone():
    """Overlapped steps: step t+1 is planned before step t's ids arrive."""
    s = scheduler(rows=1)
    r = request([1, 2, 3], max_new_tokens=10, stop=[99])
    s.add(r)
    s.admit()
    p1 = s.schedule()
    p2 = s.schedule()  # planned before p1's id is known
    assert r.position == 4
    s.update(p1, [99])
    assert r.finish_reason == "stop" and r.position == r.end == 3  # the prompt; the stop id was never fed
    assert s.update(p2, [42]) == []


def test_max_batch_rotates_the_rows_of_a_step():
    s = scheduler(rows=3, max_batch=2)
    reqs = [request([i + 1], max_new_tokens=20) for i in range(3)]
    for r in reqs:
        s.add(r)
    s.admit()
    for _ in range(3):  # prefill each
        s.update(s.schedule(), [0])
    rows = [s.schedule().decode_rows for _ in range(3)]
    assert rows == [[0, 1], [2, 0], [1, 2]]


def test_without_prefill_prompts_go_through_decode_and_only_the_last_prompt_token_is_sampled():
    s = scheduler(rows=1, has_prefill=False)
    r = request([7, 8, 9])
    s.add(r)
    s.admit()
    plans = [s.schedule() for _ in range(3)]
    assert [p.fed for p in plans] == [[(0, 7)], [(0, 8)], [(0, 9)]]
    assert [p.sample for p in plans] == [[], [], [(r, 0)]] and plans[2].sample_positions == [3]


def test_cancelled_requests_finish_at_the_next_admission():
    s = scheduler(rows=1)
    running, waiting = request([1]), request([2])
    s.add(running), s.add(waiting)
    s.admit()
    running.cancel_requested = waiting.cancel_requested = True
    assert s.admit() == []
    assert [r.finish_reason for r in s.take_finished()] == ["cancelled", "cancelled"]
    assert (s.running, s.waiting) == (0, 0)


def test_the_queue_bound_counts_only_requests_no_free_row_will_take():
    s = scheduler(rows=2, max_queue=1)
    for _ in range(3):  # two fit the free rows, one waits
        s.add(request([1]))
    with pytest.raises(QueueFullError, match="1 requests already wait for a free row"):
        s.add(request([1]))
    assert s.stats.requests_submitted == 3


class FakeReclaimer:
    """Kept conversations: idle sessions the scheduler may close for a row."""

    def __init__(self, idle: int) -> None:
        self.n = idle

    def idle(self) -> int:
        return self.n

    def reclaim(self) -> bool:
        return False


def test_a_queue_of_zero_takes_what_the_rows_take_and_kept_conversations_count_as_room():
    s = scheduler(rows=2, max_queue=0)
    s.add(request([1])), s.add(request([2]))  # both fit the free rows: nothing waits
    with pytest.raises(QueueFullError, match=r"max_queue=0"):
        s.add(request([3]))
    s.reclaimer = FakeReclaimer(idle=1)  # a kept conversation can give its row up
    s.add(request([3]))
    with pytest.raises(QueueFullError):
        s.add(request([4]))
    assert s.stats.requests_submitted == 3


def test_a_request_submitted_while_a_kept_conversation_gives_its_row_up_is_not_refused():
    """`add` runs on other threads while the loop admits: a request arriving mid-reclaim (the
    conversation gone from the cache, its row not yet free) must still see the room that is there."""
    s = scheduler(rows=2, max_queue=0)
    kept = [s.take_row(), s.take_row()]  # both rows held by kept conversations
    first, late = request([1]), request([9])

    class Reclaiming:
        entries = 2

        def idle(self):
            return self.entries

        def reclaim(self):
            self.entries -= 1  # out of the cache; its row is not free yet
            if self.entries == 1:
                s.add(late)  # a submit on another thread, right now: one kept conversation is still room
            s.free_row(kept.pop())
            return True

    s.reclaimer = Reclaiming()
    s.add(first)
    assert s.admit() == [first] and s.waiting == 1  # late waits for the other conversation's row
    with pytest.raises(QueueFullError):  # and that was the last room
        s.add(request([5]))
    assert s.admit() == [late]


def test_a_token_budget_prefills_several_prompts_per_step_cut_where_one_chunk_would_cut_them():
    s = scheduler(rows=4, chunk=4, token_budget=10)
    dec, a, b, c = request([1]), request(list(range(10, 16))), request([20, 21, 22]), request([30, 31, 32, 33, 34])
    s.add(dec)
    s.admit()
    s.update(s.schedule(), [5])  # dec decodes from now on: one token of every step's budget
    for r in (a, b, c):
        s.add(r)
    s.admit()
    p = s.schedule()  # 1 decoding + a's first chunk (4) + b's whole prompt (3) = 8; c's chunk (4) would make 12
    assert [(x.request, x.start, x.tokens) for x in p.prefills] == [(a, 0, [10, 11, 12, 13]), (b, 0, [20, 21, 22])]
    assert p.prefill is p.prefills[0] and p.decode_rows == [dec.row]
    assert p.sample == [(b, -2), (dec, 0)] and p.sample_positions == [3, 2]  # b's prompt ends in chunk 1: index -2
    s.update(p, [40, 41])
    p = s.schedule()  # a's rest (2) and c's first chunk (4) + 2 decoding = 8; cuts at 4, as without a budget
    assert [(x.request, x.start, x.tokens) for x in p.prefills] == [(a, 4, [14, 15]), (c, 0, [30, 31, 32, 33])]
    assert p.sample == [(a, -1), (dec, 0), (b, 1)]
    assert s.stats.prefill_chunks == 5 and s.stats.prefill_steps == 3


def test_the_oldest_prompt_advances_even_when_decode_fills_the_budget():
    s = scheduler(rows=3, chunk=4, token_budget=2)
    d1, d2 = request([1]), request([2])
    s.add(d1), s.add(d2)
    s.admit()
    s.update(s.schedule(), [5])
    s.update(s.schedule(), [6])
    assert d1.launched == d2.launched == 2  # both decoding
    long, later = request(list(range(10, 20))), request([7])
    s.add(long), s.add(later)
    s.admit()
    p = s.schedule()  # 2 decoding use the budget: the oldest prompt's chunk still runs, the next waits
    assert [x.request for x in p.prefills] == [long] and len(p.decode_rows) == 2


def test_a_bad_token_budget_is_refused():
    with pytest.raises(InputError, match="token_budget must be >= 1"):
        scheduler(token_budget=0)


def test_a_submit_while_admission_reads_the_queue_is_taken_next_time():
    """`add` runs on submitting threads while the loop admits: admission reads a snapshot taken under the
    queue's lock, so an append in the middle of it (here: while it reads a waiting request's cancel flag,
    where a thread switch can happen) neither raises nor gets lost."""
    s = scheduler(rows=2)
    late = request([2])

    class Racing(Request):
        fired = False

        def __getattribute__(self, name):
            if name == "cancel_requested" and not type(self).fired:
                type(self).fired = True
                s.add(late)  # another thread's submit, at this very moment
            return object.__getattribute__(self, name)

    first = Racing(0, [1], SamplingParams(), frozenset())
    s.add(first)
    assert s.admit() == [first] and Racing.fired
    assert s.admit() == [late]


def test_submits_racing_admission_on_threads_are_each_admitted_once():
    s = scheduler(rows=64)
    done = threading.Event()
    added: list[Request] = []

    def submit():
        for _ in range(400):
            r = request([1])
            s.add(r)
            added.append(r)
        done.set()

    t = threading.Thread(target=submit)
    t.start()
    admitted = []
    while not done.is_set() or s.waiting:
        admitted += s.admit()
        for r in list(admitted):
            if r.status is not RequestStatus.FINISHED:
                s.finish(r, "cancelled")
        s.take_finished()
    t.join()
    assert len(admitted) == len(set(map(id, admitted))) == len(added) == 400
    assert s.rows.free_list() == list(range(64))


def test_giving_a_row_back_twice_is_a_no_op_and_a_stale_lease_never_frees_the_next_holder():
    rows = RowAllocator(2)
    a = rows.take()
    assert rows.give_back(a) is True and rows.free_list() == [0, 1]
    assert rows.give_back(a) is False and rows.free_list() == [0, 1]  # the second release changes nothing
    b = rows.take()
    assert b.row == a.row and b != a
    assert rows.give_back(a) is False and rows.holds(b) and rows.free_list() == [1]  # a's holder is not b's


def test_a_finished_request_gives_its_own_row_back_once_unless_it_is_kept():
    s = scheduler(rows=2)
    plain, kept, cancelled = request([1], max_new_tokens=1), request([2], max_new_tokens=1, keep=True), \
        request([3], max_new_tokens=5, keep=True)
    for r in (plain, kept):
        s.add(r)
    s.admit()
    s.update(s.schedule(), [5])  # one prompt per step: plain's...
    second = s.schedule()  # ...then kept's, after the zeroing of plain's row, which went back with it
    s.update(second, [6])
    assert (plain.finish_reason, kept.finish_reason) == ("length", "length")
    assert s.rows.free_list() == [plain.row] and s.rows.holds(kept.lease)  # the kept row stays held
    assert second.state_ops == [ZeroRow(plain.row)] and len(s.ops) == 0
    assert s.free_row(plain.lease) is False  # already back: a second release is a no-op
    s.add(cancelled)
    s.admit()
    cancelled.cancel_requested = True
    s.admit()  # a cancelled request is not kept, even when asked: its row goes back
    assert cancelled.finish_reason == "cancelled" and not s.rows.holds(cancelled.lease)
    assert s.free_row(cancelled.lease) is False and sorted(s.rows.free_list()) == [plain.row]


def test_a_request_whose_admission_raises_half_way_is_still_ended_by_finish_all():
    """Admission that raises after taking the request out of the queue (a bug, or broken state) must not
    lose it: failing the engine ends every request the scheduler was given, wherever it was."""
    from onecopy.runtime.kv_manager import KVSpec

    s = Scheduler(2, max_seq_len=64, has_prefill=True, prefill_chunk=4, kv=KVSpec(8, 4, 16, True))
    r = request([1, 2, 3])
    s.add(r)

    def broken(req):
        raise RuntimeError("bookkeeping broke")

    s.kv.place = broken
    with pytest.raises(RuntimeError, match="bookkeeping broke"):
        s.admit()
    assert s.waiting == s.running == 0 and s.requests() == [r]  # in neither list, but not lost
    s.finish_all("error", RuntimeError("the engine failed"))
    assert s.take_finished() == [r] and r.finish_reason == "error" and s.requests() == []
