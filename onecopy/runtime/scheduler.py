"""The scheduler: pure policy over generation requests, on the host. It never touches a tensor.

It owns the rows of the state pool (`rows.RowAllocator`) and, for bundles with paged KV, the KV cache
manager (`kv_manager.KVCacheManager`); what their decisions mean for device memory is queued as state
operations that the next plan carries. Requests wait in a FIFO queue until a row is free (or run on
the row of the session they name). Each iteration (driven by `loop.EngineLoop`, under the engine's
lock):
1. `admit` ends cancelled requests and gives waiting ones a row (and their KV blocks) while they last;
2. `schedule` plans one step: the state operations decided so far, the admitted requests' set-up, one
   chunk of the oldest request still reading its prompt (``prefill_chunk`` tokens, cut from the
   prompt's start, so the cut never depends on other requests; a long prompt advances one chunk per
   iteration while the others keep decoding), and with a ``token_budget`` more chunks (of the next
   requests reading prompts) while the step's tokens (one per decoding request, plus the chunks')
   stay within it, as vLLM and SGLang budget an iteration; one batched decode step for every
   generating request (bundles without a prefill method feed prompts through this step too, a token
   per iteration), and which rows' logits are sampled;
3. the model runner executes the plan (`runner.ModelRunner.execute`);
4. `update` takes the step's sampled ids: each goes to its request, and requests that stop (eos,
   stop ids, max_new_tokens, max_seq_len) finish.
With paged KV, blocks are the capacity: a request on an empty row is admitted with the blocks of its
prompt and takes one more as its row crosses into it (`kv_manager.KVCacheManager.grows`); admission keeps
``new_token_ratio`` of the running requests' unwritten spans free (1 by default: none needs preempting when
they run to max_new_tokens). When a decoding row needs a block and none is free or evictable, idle
sessions the reclaimer holds are closed, then the latest running request that grows is preempted
(`preempt`; one with an id in flight is drained for a step first): its row is emptied (it keeps the row,
and its blocks stay in the prefix cache while they last) and it goes back to the head of the queue.
Admitted again, its row reads its prompt and the ids it already streamed (prefilled; in a deterministic
engine the streamed ids go through the batch-invariant decode one per step, as they first did, so the
row's bits are those of a run never preempted) and it samples on with the same seed: its stream has no
gap, and no request fails for lack of blocks.
Finishing is the scheduler's too: the request's row is rewound to what it really holds, its blocks
published and trimmed, and a row the request took is given back unless it is kept. Finished requests
(also cancelled or failed ones) are handed out by `take_finished`, for their streams to end.
Only `add` (and `backlog`) run on other threads: the waiting queue is read and changed under its own
lock, so a submit never races an admission.
"""

from __future__ import annotations

import collections
import itertools
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import InputError, OnecopyError, QueueFullError, SessionCapacityError
from .kv_manager import KVCacheManager, KVSpec
from .kv_tiers import TierIndex
from .plan import PrefillChunk, RequestStart, StateOp, StateOps, StepPlan, ZeroRow
from .request import Request, RequestStatus
from .rows import RowAllocator, RowLease

_CANCEL_REQUESTED = operator.attrgetter("cancel_requested")

__all__ = ["Reclaimer", "Request", "RequestStatus", "Scheduler", "SchedulerStats"]


class Reclaimer(Protocol):
    """Something holding idle sessions that may be closed when their rows are needed."""

    def idle(self) -> int: ...

    def reclaim(self) -> bool: ...


COPY_AHEAD_BLOCKS = 32  # blocks an idle pass saves ahead of eviction at most: the lock is let go between passes


@dataclass
class SchedulerStats:
    """Counters since the scheduler started (for monitoring)."""

    requests_submitted: int = 0
    requests_finished: dict[str, int] = field(default_factory=lambda: collections.Counter())
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of prefilled
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # requests decoded, summed over the steps (rows / steps: the mean batch)
    prefill_chunks: int = 0
    prefill_steps: int = 0  # steps with a prefill chunk (fewer than the chunks with a token budget)
    preemptions: int = 0  # running requests whose row was emptied for others' KV blocks
    peak_running: int = 0  # the most requests running at once
    recomputed_tokens: int = 0  # ids put back in rows again after preemptions (not counted in prompt_tokens)


class Scheduler:
    """Admission, chunked prefill, batched decode, stop rules and finishing, as plans (see the module doc).

    ``reclaimer`` (settable): when a waiting request needs a row and none is free, its ``reclaim()``
    closes an idle session (e.g. a cached conversation) and says whether it did; ``idle()`` counts
    those it could close. ``replay_in_decode`` (a deterministic engine): a preempted request's streamed
    ids go back into its row through the decode step, not the prefill.
    """

    def __init__(self, rows: int, *, max_seq_len: int, has_prefill: bool, prefill_chunk: int,
                 max_queue: int | None = None, max_batch: int | None = None, token_budget: int | None = None,
                 kv: KVSpec | None = None, replay_in_decode: bool = False, new_token_ratio: float = 1.0,
                 tiers: TierIndex | None = None) -> None:
        if prefill_chunk < 1:
            raise InputError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if token_budget is not None and token_budget < 1:
            raise InputError(f"token_budget must be >= 1 (tokens per iteration), got {token_budget}")
        if max_queue is not None and max_queue < 0:
            raise InputError(f"max_queue must be >= 0, got {max_queue}")
        if max_batch is not None and max_batch < 1:
            raise InputError(f"max_batch must be >= 1, got {max_batch}")
        self.max_seq_len, self.has_prefill = max_seq_len, has_prefill
        self.prefill_chunk, self.max_queue, self.max_batch = prefill_chunk, max_queue, max_batch
        self.token_budget, self.replay_in_decode, self.new_token_ratio = token_budget, replay_in_decode, new_token_ratio
        self.stats = SchedulerStats()
        self.reclaimer: Reclaimer | None = None
        self.ops = StateOps()  # device work decided and not yet applied (the next plan carries it)
        self.rows = RowAllocator(rows)
        self.kv = KVCacheManager(kv, rows, max_seq_len, self.ops, tiers) if kv is not None else None
        self._queue_lock = threading.Lock()  # guards _waiting and _unfinished: `add` runs on submitting threads
        self._waiting: collections.deque[Request] = collections.deque()
        # Waiting requests that need no row (a session's, or a preempted one that kept its row): while there are
        # none, an admission that runs out of rows or blocks can stop scanning a queue of thousands.
        self._waiting_with_row = 0
        # Every request from `add` until it finishes, whatever list it is in (or between two, when admission
        # raises half-way): `finish_all` ends each one, so no stream is ever left waiting.
        self._unfinished: dict[Request, None] = {}
        self._running: list[Request] = []  # admitted, in admission order
        self._starts: list[RequestStart] = []  # admitted since the last plan: set up by the next one
        self._finished: list[Request] = []  # ended since the last take_finished()
        self._rotation = 0  # where the next decode step starts when max_batch cuts the batch

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def requests(self) -> list[Request]:
        """Every request not finished, in the order they were added."""
        with self._queue_lock:
            return list(self._unfinished)

    # -- rows ----------------------------------------------------------------------------------------
    def take_row(self) -> RowLease:
        """Lease a free row for a session opened directly (the caller checks `rows.free_rows`)."""
        return self.rows.take()

    def free_row(self, lease: RowLease) -> bool:
        """Give a row back (its KV blocks too; the row is zeroed before anything runs on it again).
        A no-op (False) unless ``lease`` still holds the row: each row goes back exactly once."""
        if not self.rows.give_back(lease):
            return False
        if self.kv is not None:
            self.kv.release(lease.row)
        self.ops.add(ZeroRow(lease.row))
        return True

    # -- intake (any thread) ----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a checked request; QueueFullError when ``max_queue`` requests already wait for a row."""
        with self._queue_lock:
            if self.max_queue is not None and req.owns_row and self._backlog(extra=1) > self.max_queue:
                raise QueueFullError(f"{self._backlog()} requests already wait for a free row "
                                     f"(max_queue={self.max_queue}); retry later, or load the engine with a larger "
                                     "max_queue")
            req.arrival = self.stats.requests_submitted  # victims of preemption are the latest to arrive
            self._waiting.append(req)
            self._waiting_with_row += not req.needs_row
            self._unfinished[req] = None
            self.stats.requests_submitted += 1

    def backlog(self, extra: int = 0) -> int:
        """Queued requests (plus ``extra`` about to be) that no row will take at the next admission.

        Requests not admitted yet while rows are free are not waiting for a row: counting them would
        refuse a burst that fits the pool. Rows held by idle sessions the reclaimer can close (kept
        conversations) count as free. `admit` takes a request out of the queue before it reclaims or
        takes a row, so every state in between counts the same room or one more, never less.
        """
        with self._queue_lock:
            return self._backlog(extra)

    def _backlog(self, extra: int = 0) -> int:
        need_row = extra + sum(1 for r in self._waiting if r.needs_row and not r.cancel_requested)
        reclaimable = self.reclaimer.idle() if self.reclaimer is not None else 0
        return max(0, need_row - self.rows.free_rows - reclaimable)

    def idle_ops(self) -> list[StateOp]:
        """State operations to carry out while nothing runs: those decided and not applied yet (the last
        requests' cached blocks copied to the host tier), and the cached blocks the KV cache evicts first
        saved to the host tier ahead of their eviction (`KVCacheManager.copy_ahead`)."""
        if self.kv is not None:
            self.kv.copy_ahead(COPY_AHEAD_BLOCKS)
        return self.ops.take() if self.ops else []

    def has_work(self) -> bool:
        """Whether an iteration would do anything now (`admit`'s rules: a request waiting for blocks holds
        back the later ones; an idle session the reclaimer can close makes room for a row or blocks)."""
        if self._running or self._starts:
            return True
        with self._queue_lock:
            waiting = list(self._waiting)
        free = self.rows.free_rows
        idle = self.reclaimer is not None and self.reclaimer.idle() > 0
        blocked, promised = False, self._promised()
        for r in waiting:
            if r.cancel_requested:
                return True
            if r.starts_empty and blocked:
                continue
            if not self._fits(r, promised):
                if r.starts_empty and idle:
                    return True
                blocked = blocked or r.starts_empty
                continue
            if not r.needs_row or free > 0 or idle:
                return True
        return False

    def _fits(self, req: Request, promised: float) -> bool:
        return self.kv is None or self.kv.fits(req, promised, self.new_token_ratio)

    def _promised(self) -> float:
        """The blocks running requests may still take, times ``new_token_ratio`` (kept free at admission)."""
        if self.kv is None or not self.new_token_ratio:
            return 0.0
        return sum(self.kv.to_come(r, self.new_token_ratio) for r in self._running)

    def _dequeue(self, req: Request) -> int:
        with self._queue_lock:
            at = self._waiting.index(req)  # near the head: admission takes requests in order
            del self._waiting[at]
            self._waiting_with_row -= not req.needs_row
            return at

    # -- one iteration -----------------------------------------------------------------------------
    def admit(self) -> list[Request]:
        """End cancelled requests; give waiting ones a row (and blocks) while they last, preempted ones
        first. Returns the requests admitted for the first time."""
        with self._queue_lock:
            waiting = list(self._waiting)  # a snapshot: `add` appends on other threads
        cancelled = itertools.compress(waiting, map(_CANCEL_REQUESTED, waiting))  # C-speed over a long queue
        for req in [*cancelled, *(r for r in self._running if r.cancel_requested)]:
            self.finish(req, "cancelled")
        admitted = []
        blocked = False  # the oldest request needing a row waits for KV blocks: later ones must not overtake it
        rows_out = False  # a request needing a row found none: rows free only as requests end, so later ones neither
        promised = self._promised() if waiting else 0.0  # O(running): not on a step with nothing to admit
        for req in waiting:
            if (blocked or rows_out) and not self._waiting_with_row:
                break  # every request left needs a row: none can start (30000 queued: no scan per step)
            if req.status is not RequestStatus.WAITING or req.starts_empty and blocked or req.needs_row and rows_out:
                continue
            fits = self._fits(req, promised)
            while not fits and req.starts_empty and self._reclaim_idle():
                fits = self._fits(req, promised)  # an idle session's blocks went back
            if not fits:
                blocked = blocked or req.starts_empty
                continue  # waits for KV blocks (requests end and give theirs back)
            at = self._dequeue(req)  # out of the queue before a row changes hands (see `backlog`)
            if req.needs_row:
                if self.rows.free_rows == 0 and not (self.reclaimer is not None and self.reclaimer.reclaim()):
                    with self._queue_lock:
                        self._waiting.insert(at, req)  # it needs a row: not counted in _waiting_with_row
                    rows_out = True
                    continue  # waits for a row; requests on their own session may still go ahead
                req.lease = self.rows.take()
            first = not req.admitted
            if first:
                req.admitted, req.seed = True, req.params.draw_seed()
            req.position = req.start
            if self.kv is not None:
                try:
                    self.kv.place(req)
                except OnecopyError as e:
                    self.finish(req, "error", e)
                    continue
            self._running.append(req)
            req.status, req.reserve = RequestStatus.PREFILLING, False
            if self.kv is not None:
                promised += self.kv.to_come(req, self.new_token_ratio)
            req.position, req.fed = req.start + req.cached, req.cached
            self._starts.append(RequestStart(req.row, req.params, req.feed(0, req.feed_len), req.encode_inputs,
                                             req.seed, req.feed(len(req.prompt), req.feed_len)))
            if first:
                self.stats.prompt_tokens += len(req.prompt)
                self.stats.cached_tokens += req.cached
                admitted.append(req)
        self.stats.peak_running = max(self.stats.peak_running, len(self._running))
        return admitted

    def schedule(self) -> StepPlan | None:
        """Plan the next step and advance the requests' bookkeeping as if it ran (None: nothing to do).

        The positions a plan names are the rows' before it; afterwards each request's position counts
        the tokens the step puts in its row.
        """
        # The decode step's requests, chosen before any prompt advances (a prompt that ends in this
        # step's chunk is sampled from its chunk, and decodes from the next step on).
        step = [r for r in self._running if not r.exhausted and (not r.reading_prompt and r.launched > 0
                                                                  or r.reading_prompt and self._fed_by_decode(r))]
        if self.max_batch is not None and len(step) > self.max_batch:
            k = self._rotation % len(step)
            step = (step[k:] + step[:k])[:self.max_batch]
            self._rotation += self.max_batch
        if self.kv is not None:
            step = self._grow(step)
        plan = StepPlan(starts=self._starts)  # after `_grow`: a preempted request is set up no more
        self._starts = []
        if self.has_prefill:
            self._plan_prefills(plan, len(step))
        for i, r in enumerate(step):
            plan.decode_rows.append(r.row)
            plan.decode_positions.append(r.position)
            if r.reading_prompt:
                plan.fed.append((r.row, r.feed(r.fed, r.fed + 1)[0]))
                if r.preemptions:
                    self.stats.recomputed_tokens += 1
            # Sampled: every step row but those with more prompt to feed after this token.
            if not r.reading_prompt or r.fed + 1 == r.feed_len:
                plan.sample.append((r, i))
                plan.sample_positions.append(r.position + 1)
            r.position += 1
            if r.reading_prompt:
                r.fed += 1
        if step:
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(step)
        for req, _ in plan.sample:
            plan.sample_first.append(req.launched == 0)
            req.launched += 1
            req.status = RequestStatus.DECODING
            # Known now, without the id: this was the request's last token (the stop ids wait for the id).
            req.exhausted = req.launched >= req.params.max_new_tokens or req.position >= self.max_seq_len
        plan.state_ops = self.ops.take()  # what admission and `_grow` decided, applied before the step
        if not (plan.state_ops or plan.starts or plan.prefills or step):
            return None
        return plan

    def _fed_by_decode(self, req: Request) -> bool:
        """Whether the next id a request reads goes through the decode step (no prefill method; or, in a
        deterministic engine, an id it streamed before a preemption: the decode step wrote it first)."""
        return not self.has_prefill or self.replay_in_decode and req.fed >= len(req.prompt)

    def _prefill_end(self, req: Request) -> int:
        """Where a request's prefill stops: after its prompt, or after the ids it resumes (see `_fed_by_decode`)."""
        return len(req.prompt) if self.replay_in_decode else req.feed_len

    def _grow(self, step: list[Request]) -> list[Request]:
        """Each step row's position made writable (a block taken as the row crosses into one, in step order).

        While the blocks are not there, idle sessions the reclaimer can close (kept conversations) go first,
        then the running request that grows and arrived last is preempted (the row itself, at worst). One
        with an id still on its way (overlapped steps) is drained instead: it and every row still short of a
        block sit this step out, and it is preempted at the next, its ids all back. So a request never ends
        on an id it had in flight while its row is empty: a kept session always holds its conversation.
        Returns the step's requests that run."""
        kv, held = self.kv, set()
        for r in step:
            if r in held or r.status in (RequestStatus.WAITING, RequestStatus.FINISHED):
                continue  # preempted or drained for an earlier row of this step
            need = kv.cost(r.row, r.position, r.position + 1)
            while need > kv.available:
                if self._reclaim_idle():
                    continue
                victim = None if held else max(
                    (q for q in self._running if kv.grows(q) and not q.exhausted), key=lambda q: q.arrival, default=None)
                if victim is None and not held:  # only a request that reserved its span gets here: it never needs one
                    self.finish(r, "error", SessionCapacityError(
                        f"row {r.row} needs a KV block at position {r.position} and none is free; this is a bug in "
                        "onecopy's block accounting, please report it"))
                    break
                if victim is None or victim.launched > victim.generated:
                    held.add(r)
                    if victim is not None:
                        held.add(victim)
                    break
                self.preempt(victim)
                if victim is r:
                    # Nothing else grows: the blocks are held by requests that reserved theirs and sessions. Resumed
                    # on what it reads now, it would be here again at once; it waits for all it may write instead.
                    r.reserve = not any(kv.grows(q) for q in self._running)
                    break
            else:
                if need:  # nothing to do at a position inside a block the row holds alone
                    kv.prepare(r.row, r.position, r.position + 1)
        return [r for r in step if r not in held and r.status not in (RequestStatus.WAITING, RequestStatus.FINISHED)]

    def _reclaim_idle(self) -> bool:
        """Close an idle session the reclaimer holds (its row and KV blocks free); whether one was closed."""
        return self.reclaimer is not None and self.reclaimer.idle() > 0 and self.reclaimer.reclaim()

    def preempt(self, req: Request) -> None:
        """Empty the row of running ``req`` (one that `grows`, with no id on its way) for others' KV blocks
        and queue it first. It keeps its row; its blocks are published (the prefix cache) and released, the
        row zeroed. Everything it sampled is in ``output``: its next admission puts the prompt and those
        ids back (``resumed``)."""
        self._running.remove(req)
        self._starts = [s for s in self._starts if s.row != req.row]  # admitted in this iteration: not set up
        self.kv.preempted(req)
        self.ops.add(ZeroRow(req.row))
        req.status, req.exhausted = RequestStatus.WAITING, False
        req.resumed = req.launched
        req.position, req.fed, req.cached = req.start, 0, 0  # its row holds nothing (see `Request.end`)
        req.preemptions += 1
        self.stats.preemptions += 1
        with self._queue_lock:
            self._waiting.appendleft(req)
            self._waiting_with_row += not req.needs_row

    def _plan_prefills(self, plan: StepPlan, decoding: int) -> None:
        """The step's prefill chunks: the oldest prompt's next chunk, then (with a token budget) the next
        prompts' while the step's tokens fit. A chunk is always a whole ``prefill_chunk`` cut (or a
        prompt's rest): the budget decides which prompts advance, never where a prompt is cut."""
        budget = (self.token_budget or 0) - decoding
        for req in [r for r in self._running if r.fed < self._prefill_end(r)]:
            end = self._prefill_end(req)
            chunk = req.feed(req.fed, min(req.fed + self.prefill_chunk, end))
            if plan.prefills and len(chunk) > budget:
                break  # in admission order: a later, shorter chunk does not overtake this one
            budget -= len(chunk)
            plan.prefills.append(PrefillChunk(req, req.row, req.position, chunk))
            if req.preemptions:
                self.stats.recomputed_tokens += len(chunk)
            req.fed += len(chunk)
            req.position += len(chunk)
            self.stats.prefill_chunks += 1
            if req.fed == end:
                if not req.reading_prompt:
                    plan.sample.append((req, -len(plan.prefills)))
                    plan.sample_positions.append(req.position)
                if self.kv is not None:
                    self.kv.prefilled(req)
        self.stats.prefill_steps += bool(plan.prefills)

    def update(self, plan: StepPlan, ids: Sequence[int]) -> list[tuple[Request, int]]:
        """The sampled ids of ``plan`` (in its sample order): the (request, id) pairs to stream; requests
        that stop with them finish. Ids of requests finished meanwhile are dropped."""
        out = []
        for req, token_id in zip(plan.sampled, ids):
            if req.status is RequestStatus.FINISHED:
                continue  # cancelled meanwhile, or an extra step after its stop id (overlap)
            req.output.append(token_id)
            self.stats.generated_tokens += 1
            out.append((req, token_id))
            if token_id in req.stop_ids:
                self.finish(req, "stop")
            elif req.generated >= req.params.max_new_tokens or req.start + len(req.prompt) + req.generated > \
                    self.max_seq_len:
                self.finish(req, "length")
        return out

    def finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        """End a request (``reason``: stop, length, cancelled, error): its row rewound to what it holds,
        its blocks published and trimmed, a row it took given back unless kept. `take_finished` hands it
        out (even if that bookkeeping raises: the request has ended whatever happens to its row)."""
        if req.status is RequestStatus.FINISHED:
            return
        if req in self._running:
            self._running.remove(req)
        with self._queue_lock:
            if req.status is RequestStatus.WAITING and req in self._waiting:  # not a scan of the queue per finish
                self._waiting.remove(req)
                self._waiting_with_row -= not req.needs_row
            self._unfinished.pop(req, None)
        req.status, req.finish_reason, req.error = RequestStatus.FINISHED, reason, error
        self.stats.requests_finished[reason] += 1
        self._finished.append(req)
        if req.admitted:
            req.position = req.end  # undo positions fed by steps queued after the last id
            if self.kv is not None:
                self.kv.finished(req)
            if req.owns_row and not self.kept(req):
                self.free_row(req.lease)

    @staticmethod
    def kept(req: Request) -> bool:
        """Whether a finished request's row stays held (asked for, and the request ended well)."""
        return req.keep_row and req.finish_reason in ("stop", "length")

    def finish_all(self, reason: str, error: BaseException | None = None) -> None:
        """End every request not finished. A bookkeeping error on one (the state is broken: the engine is
        failing) keeps none of the others from ending; the first such error is raised afterwards."""
        first = None
        with self._queue_lock:  # the queue emptied at once: finishing 30000 queued ones must not search it each time
            self._waiting.clear()
            self._waiting_with_row = 0
        for req in self.requests():
            try:
                self.finish(req, reason, error)
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    def take_finished(self) -> list[Request]:
        """Requests finished since the last call, in the order they finished."""
        out, self._finished = self._finished, []
        return out
