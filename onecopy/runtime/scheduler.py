"""The scheduler: pure policy over generation requests. It never touches a tensor.

Requests wait in a FIFO queue until a state-pool row is free (or run on the session they name).
Each iteration (driven by `loop.EngineLoop`):
1. `admit` drops cancelled requests and gives waiting ones a row (a session) each;
2. `schedule` plans one step: one chunk of the oldest request still reading its prompt
   (``prefill_chunk`` tokens, cut from the prompt's start, so the cut never depends on other
   requests; a long prompt advances one chunk per iteration while the others keep decoding), and
   with a ``token_budget`` more chunks (of the next requests reading prompts) while the step's
   tokens (one per decoding session, plus the chunks') stay within it, as vLLM and SGLang budget
   an iteration: many sessions' prompts get into the state without starving decode; one
   batched decode step for every generating session (bundles without a prefill method feed prompts
   through this step too, a token per iteration), and which rows' logits are sampled;
3. the model runner executes the plan (`runner.ModelRunner.execute`);
4. `update` takes the step's sampled ids: each goes to its request, and requests that stop (eos,
   stop ids, max_new_tokens, max_seq_len) finish.
Finished requests (also cancelled or failed ones) are handed out by `take_finished`, for the loop to
release their rows and end their streams.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import InputError, OnecopyError, QueueFullError
from ..sampling import SamplingParams

if TYPE_CHECKING:
    from .session import Session


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for a row
    PREFILLING = "prefilling"  # admitted, its prompt not all in the state yet
    DECODING = "decoding"  # generating
    FINISHED = "finished"  # see finish_reason


@dataclass(eq=False)  # identity: a request is itself, whatever its fields hold
class Request:
    """One generation request and where it stands. ``stream`` is the consumer's handle (opaque here)."""

    id: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    session: "Session | None"  # the session it runs on (given by the caller, or opened at admission)
    own_session: bool  # opened at admission: closed when the request ends (unless keep_session)
    keep_session: bool = False
    encode_inputs: tuple[Any, ...] | None = None  # the encode method's inputs, run on the row at admission
    stream: Any = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    error: BaseException | None = None
    cancel_requested: bool = False
    fed: int = 0  # prompt tokens in the state so far
    launched: int = 0  # tokens sampled on the device
    generated: int = 0  # tokens whose ids came back
    exhausted: bool = False  # its last token is launched: no more steps
    start: int = 0  # the session's position before the prompt (its first `cached` tokens already in the state)
    admitted: bool = False  # got its session (stays true after it finishes)
    cached: int = 0  # prompt tokens found in the prefix cache: in the state at admission, not prefilled
    base: list[int] | None = None  # the ids the session held before the prompt (None: unknown), for the cache

    @property
    def reading_prompt(self) -> bool:
        return self.fed < len(self.prompt)



@dataclass
class PrefillChunk:
    """Prompt ids ``tokens`` of ``request`` into its row from position ``start``."""

    request: Request
    row: int
    start: int
    tokens: list[int]


@dataclass
class StepPlan:
    """One iteration's device work, decided by `Scheduler.schedule` and executed by the model runner."""

    prefills: list[PrefillChunk] = field(default_factory=list)  # run first, in this order
    decode_rows: list[int] = field(default_factory=list)  # one batched decode step over these rows...
    decode_positions: list[int] = field(default_factory=list)  # ...at these positions
    fed: list[tuple[int, int]] = field(default_factory=list)  # (row, prompt id): its decode input is this id
    # Whose logits are sampled, in this order: (request, index into the decode rows, or -1 - i: prefills[i]'s).
    sample: list[tuple[Request, int]] = field(default_factory=list)
    sample_positions: list[int] = field(default_factory=list)  # each sampled row's position after the step
    sample_first: list[bool] = field(default_factory=list)  # its request's first sampled token

    @property
    def prefill(self) -> PrefillChunk | None:
        """The first prefill chunk (the only one without a token budget), or None."""
        return self.prefills[0] if self.prefills else None

    @property
    def sampled(self) -> list[Request]:
        return [r for r, _ in self.sample]

    @property
    def sample_rows(self) -> list[int]:
        return [r.session.row for r, _ in self.sample]


class Rows(Protocol):
    """Where admitted requests get their sessions (the Engine)."""

    @property
    def free_rows(self) -> int: ...

    def open_session(self) -> "Session": ...


class BlockAdmission(Protocol):
    """Where requests get their KV blocks, for bundles with paged KV (the Engine)."""

    def fits(self, req: Request) -> bool: ...  # enough blocks free or evictable for the request now

    def place(self, req: Request) -> None: ...  # take them (and a cached prefix); sets req.cached

    def prefilled(self, req: Request) -> None: ...  # its prompt is all in the state (queued): publish it


class Reclaimer(Protocol):
    """Something holding idle sessions that may be closed when their rows are needed."""

    def idle(self) -> int: ...

    def reclaim(self) -> bool: ...


@dataclass
class SchedulerStats:
    """Counters since the scheduler started (for monitoring)."""

    requests_submitted: int = 0
    requests_finished: dict[str, int] = field(default_factory=lambda: collections.Counter())
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of prefilled
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sessions decoded, summed over the steps (rows / steps: the mean batch)
    prefill_chunks: int = 0
    prefill_steps: int = 0  # steps with a prefill chunk (fewer than the chunks with a token budget)


class Scheduler:
    """Admission, chunked prefill, batched decode and stop rules, as plans (see the module doc).

    Not thread-safe by itself: `loop.EngineLoop` calls it under its locks. ``reclaimer`` (settable):
    when a waiting request needs a row and none is free, its ``reclaim()`` closes an idle session
    (e.g. a cached conversation) and says whether it did; ``idle()`` counts those it could close.
    """

    def __init__(self, rows: Rows, *, max_seq_len: int, has_prefill: bool, prefill_chunk: int,
                 max_queue: int | None = None, max_batch: int | None = None,
                 blocks: BlockAdmission | None = None, token_budget: int | None = None) -> None:
        if prefill_chunk < 1:
            raise InputError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if token_budget is not None and token_budget < 1:
            raise InputError(f"token_budget must be >= 1 (tokens per iteration), got {token_budget}")
        if max_queue is not None and max_queue < 0:
            raise InputError(f"max_queue must be >= 0, got {max_queue}")
        if max_batch is not None and max_batch < 1:
            raise InputError(f"max_batch must be >= 1, got {max_batch}")
        self.rows, self.max_seq_len, self.has_prefill = rows, max_seq_len, has_prefill
        self.prefill_chunk, self.max_queue, self.max_batch = prefill_chunk, max_queue, max_batch
        self.token_budget = token_budget
        self.stats = SchedulerStats()
        self.reclaimer: Reclaimer | None = None
        self.blocks = blocks  # paged KV: a request is admitted only when its blocks are there
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []  # admitted, in admission order
        self._finished: list[Request] = []  # ended since the last take_finished()
        self._rotation = 0  # where the next decode step starts when max_batch cuts the batch

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def requests(self) -> list[Request]:
        """Every request not finished: waiting, then running."""
        return list(self._waiting) + list(self._running)

    # -- intake ------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a checked request; QueueFullError when ``max_queue`` requests already wait for a row."""
        if self.max_queue is not None and req.own_session and self.backlog(extra=1) > self.max_queue:
            raise QueueFullError(f"{self.backlog()} requests already wait for a free row (max_queue={self.max_queue}); "
                                 "retry later, or load the engine with a larger max_queue")
        self._waiting.append(req)
        self.stats.requests_submitted += 1

    def backlog(self, extra: int = 0) -> int:
        """Queued requests (plus ``extra`` about to be) that no row will take at the next admission.

        Requests not admitted yet while rows are free are not waiting for a row: counting them would
        refuse a burst that fits the pool (three at once into two rows and a queue of two got a 429
        when no loop iteration ran between the submits). Rows held by idle sessions the reclaimer can
        close (kept conversations) count as free: a new request takes one of them at admission.
        Called from submitting threads while the loop admits: `admit` takes a request out of the queue
        before it reclaims or takes a row, so every state in between counts the same room or one
        more, never less (a request is never refused for a row that is changing hands).
        """
        need_row = extra + sum(1 for r in list(self._waiting) if r.own_session and not r.cancel_requested)
        reclaimable = self.reclaimer.idle() if self.reclaimer is not None else 0
        return max(0, need_row - self.rows.free_rows - reclaimable)

    def has_work(self) -> bool:
        """Whether an iteration would do anything now."""
        if self._running:
            return True
        free = self.rows.free_rows
        if free == 0 and self.reclaimer is not None and self.reclaimer.idle() and any(r.own_session for r in self._waiting):
            return True  # an idle session can make room
        return any(r.cancel_requested or (not r.own_session or free > 0) and self._fits(r) for r in self._waiting)

    def _fits(self, req: Request) -> bool:
        return self.blocks is None or self.blocks.fits(req)

    # -- one iteration -----------------------------------------------------------------------------
    def admit(self) -> list[Request]:
        """Finish cancelled requests; give waiting ones a session while rows last. Returns the admitted."""
        for req in [r for r in self._waiting if r.cancel_requested] + [r for r in self._running if r.cancel_requested]:
            self.finish(req, "cancelled")
        admitted = []
        blocked = False  # the oldest request needing a row waits for KV blocks: later ones must not overtake it
        for req in list(self._waiting):
            if req.own_session and blocked:
                continue
            if not self._fits(req):
                blocked = blocked or req.own_session
                continue  # waits for KV blocks (requests end and give theirs back)
            if req.own_session:
                # Out of the queue before a kept conversation is reclaimed or a row taken: `add` runs on
                # other threads, and its bound must never see a request counted both waiting and seated.
                at = self._waiting.index(req)
                self._waiting.remove(req)
                if self.rows.free_rows == 0 and not (self.reclaimer is not None and self.reclaimer.reclaim()):
                    self._waiting.insert(at, req)
                    continue  # waits for a row; requests on their own session may still go ahead
                try:
                    req.session = self.rows.open_session()
                except OnecopyError as e:
                    self.finish(req, "error", e)
                    continue
            else:
                self._waiting.remove(req)
            if self.blocks is not None:
                try:
                    self.blocks.place(req)
                except OnecopyError as e:
                    req.admitted = True  # its session is the engine's to release
                    self.finish(req, "error", e)
                    continue
            self._running.append(req)
            req.status, req.admitted = RequestStatus.PREFILLING, True
            req.start, req.fed = req.session.position - req.cached, req.cached
            self.stats.prompt_tokens += len(req.prompt)
            self.stats.cached_tokens += req.cached
            admitted.append(req)
        return admitted

    def schedule(self) -> StepPlan | None:
        """Plan the next step and advance the requests' bookkeeping as if it ran (None: nothing to do).

        The positions a plan names are the sessions' before it; afterwards each session's position
        counts the tokens the step puts in its state.
        """
        if not self._running:
            return None
        plan = StepPlan()
        # The decode step's sessions, chosen before any prompt advances (a prompt that ends in this
        # step's chunk is sampled from its chunk, and decodes from the next step on).
        step = [r for r in self._running if not r.exhausted and (not r.reading_prompt and r.launched > 0
                                                                  or (not self.has_prefill and r.reading_prompt))]
        if self.max_batch is not None and len(step) > self.max_batch:
            k = self._rotation % len(step)
            step = (step[k:] + step[:k])[:self.max_batch]
            self._rotation += self.max_batch
        if self.has_prefill:
            self._plan_prefills(plan, len(step))
        for i, r in enumerate(step):
            plan.decode_rows.append(r.session.row)
            plan.decode_positions.append(r.session.position)
            if r.reading_prompt:
                plan.fed.append((r.session.row, r.prompt[r.fed]))
            # Sampled: every step row but those with more prompt to feed after this token.
            if not r.reading_prompt or r.fed + 1 == len(r.prompt):
                plan.sample.append((r, i))
                plan.sample_positions.append(r.session.position + 1)
            r.session.position += 1
            if r.reading_prompt:
                r.fed += 1
        if step:
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(step)
        if not plan.sample:
            return plan if plan.prefills or step else None
        for req, _ in plan.sample:
            plan.sample_first.append(req.launched == 0)
            req.launched += 1
            req.status = RequestStatus.DECODING
            # Known now, without the id: this was the request's last token (the stop ids wait for the id).
            req.exhausted = req.launched >= req.params.max_new_tokens or req.session.position >= self.max_seq_len
        return plan

    def _plan_prefills(self, plan: StepPlan, decoding: int) -> None:
        """The step's prefill chunks: the oldest prompt's next chunk, then (with a token budget) the next
        prompts' while the step's tokens fit. A chunk is always a whole ``prefill_chunk`` cut (or a
        prompt's rest): the budget decides which prompts advance, never where a prompt is cut."""
        budget = (self.token_budget or 0) - decoding
        for req in [r for r in self._running if r.reading_prompt]:
            chunk = req.prompt[req.fed:req.fed + self.prefill_chunk]
            if plan.prefills and len(chunk) > budget:
                break  # in admission order: a later, shorter chunk does not overtake this one
            budget -= len(chunk)
            plan.prefills.append(PrefillChunk(req, req.session.row, req.session.position, chunk))
            req.fed += len(chunk)
            req.session.position += len(chunk)
            self.stats.prefill_chunks += 1
            if not req.reading_prompt:
                plan.sample.append((req, -len(plan.prefills)))
                plan.sample_positions.append(req.session.position)
                if self.blocks is not None:
                    self.blocks.prefilled(req)
        self.stats.prefill_steps += bool(plan.prefills)

    def update(self, plan: StepPlan, ids: Sequence[int]) -> list[tuple[Request, int]]:
        """The sampled ids of ``plan`` (in its sample order): the (request, id) pairs to stream; requests
        that stop with them finish. Ids of requests finished meanwhile are dropped."""
        out = []
        for req, token_id in zip(plan.sampled, ids):
            if req.status is RequestStatus.FINISHED:
                continue  # cancelled meanwhile, or an extra step after its stop id (overlap)
            req.generated += 1
            self.stats.generated_tokens += 1
            out.append((req, token_id))
            if token_id in req.stop_ids:
                self.finish(req, "stop")
            elif req.generated >= req.params.max_new_tokens or req.start + len(req.prompt) + req.generated > \
                    self.max_seq_len:
                self.finish(req, "length")
        return out

    def finish(self, req: Request, reason: str, error: BaseException | None = None) -> None:
        """End a request (``reason``: stop, length, cancelled, error); `take_finished` hands it out."""
        if req.status is RequestStatus.FINISHED:
            return
        if req in self._running:
            self._running.remove(req)
        if req in self._waiting:
            self._waiting.remove(req)
        if req.admitted and req.session is not None:  # undo positions fed by steps queued after the last id
            req.session.position = min(req.session.position, req.start + len(req.prompt) + max(req.generated - 1, 0))
        req.status, req.finish_reason, req.error = RequestStatus.FINISHED, reason, error
        self.stats.requests_finished[reason] += 1
        self._finished.append(req)

    def finish_all(self, reason: str, error: BaseException | None = None) -> None:
        """End every waiting and running request."""
        for req in self.requests():
            self.finish(req, reason, error)

    def fail_running(self, error: BaseException) -> None:
        """A step failed: every running request ends with "error"."""
        for req in list(self._running):
            self.finish(req, "error", error)

    def take_finished(self) -> list[Request]:
        """Requests finished since the last call, in the order they finished."""
        out, self._finished = self._finished, []
        return out
