"""The scheduler: one loop that owns the device and serves every generation request.

Requests wait in a FIFO queue until a state-pool row is free (or run on the session they name).
Each iteration of the loop, under the engine's lock:
1. admits waiting requests (a row each; the encode method runs for requests that carry an input);
2. prefills one chunk of the oldest request still reading its prompt (``prefill_chunk`` tokens,
   cut from the prompt's start, so the cut never depends on other requests): a long prompt
   advances one chunk per iteration while the others keep decoding;
3. decodes one token for every generating session in one batched step (bundles without a
   prefill method feed prompts through this step too, a token per iteration);
4. samples every row that has fresh logits in one call and copies the ids to the host once;
5. streams each id to its request and retires requests that stop (eos, stop ids, max_new_tokens,
   max_seq_len) or were cancelled, freeing their rows at once.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from ..errors import EngineClosedError, InputError, OnecopyError, PromptTooLongError, QueueFullError
from ..sampling import SamplingParams, to_device

if TYPE_CHECKING:
    from .engine import Engine
    from .session import Session


class TokenStream:
    """The ids of one request as they are generated. Iterate it from a thread, or ``async for`` it.

    After the last id, ``finish_reason`` says why it ended: "stop" (an eos or stop id, included
    as the last id), "length" (max_new_tokens or max_seq_len), "cancelled", or "error" (iterating
    raises the error). ``cancel()`` ends it and frees its row before returning.
    """

    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams) -> None:
        self.id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.submitted = time.perf_counter()
        self.token_times: list[float] = []  # perf_counter() when each id reached the stream
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._cancel_requested = False
        self._scheduler: Scheduler | None = None
        self.session: "Session | None" = None  # the session it ran on; the caller's to close with keep_session

    # -- producer side (the scheduler loop) ---------------------------------------------------
    def _push(self, token_id: int) -> None:
        with self._cond:
            self.ids.append(token_id)
            self.token_times.append(time.perf_counter())
            self._cond.notify_all()
        self._wake_async()

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        with self._cond:
            if self.finish_reason is not None:
                return
            self.finish_reason, self.error = reason, error
            self._cond.notify_all()
        self._wake_async()

    def _wake_async(self) -> None:
        for loop, event in list(self._waiters):
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop is closed
                pass

    # -- consumer side --------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.ids)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from submit to the first id, or None before it."""
        return self.token_times[0] - self.submitted if self.token_times else None

    def __iter__(self) -> Iterator[int]:
        i = 0
        while True:
            with self._cond:
                while i >= len(self.ids) and self.finish_reason is None:
                    self._cond.wait()
                if i < len(self.ids):
                    token = self.ids[i]
                else:
                    break
            i += 1
            yield token
        if self.error is not None:
            raise self.error

    async def __aiter__(self) -> AsyncIterator[int]:
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        self._waiters.append((loop, event))
        try:
            i = 0
            while True:
                event.clear()  # before reading: a push after the read sets it again
                with self._cond:
                    new, done = self.ids[i:], self.finish_reason is not None
                for token in new:
                    i += 1
                    yield token
                if not new:
                    if done:
                        break
                    await event.wait()
            if self.error is not None:
                raise self.error
        finally:
            self._waiters.remove((loop, event))

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until the request ends; its ids (raises its error, if any)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.finish_reason is not None, timeout):
                raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return list(self.ids)

    def cancel(self, wait: bool = True) -> None:
        """Stop generating. With ``wait`` (and off the loop thread) the request's row is free when this
        returns; without, within one scheduler iteration (for callers that must not block, like an event loop)."""
        if self.done:
            return
        self._cancel_requested = True
        sched = self._scheduler
        if sched is None:
            self._finish("cancelled")
            return
        sched._wake()
        if wait and threading.current_thread() is not sched._thread:
            with self._cond:
                self._cond.wait_for(lambda: self.finish_reason is not None, timeout=60)


@dataclass(eq=False)  # identity: a request is itself, whatever its fields hold
class _Request:
    stream: TokenStream
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    session: "Session | None"  # the session it runs on (given by the caller, or opened at admission)
    own_session: bool  # opened by the scheduler: closed when the request ends (unless keep_session)
    keep_session: bool = False
    encode_inputs: tuple[torch.Tensor, ...] | None = None
    fed: int = 0  # prompt tokens in the state so far
    launched: int = 0  # tokens sampled on the device
    generated: int = 0  # tokens that reached the stream
    exhausted: bool = False  # its last token is launched: no more steps
    start: int = 0  # the session's position when the request was admitted
    admitted: bool = False

    @property
    def reading_prompt(self) -> bool:
        return self.fed < len(self.prompt)


class Reclaimer(Protocol):
    """Something holding idle sessions that may be closed when their rows are needed."""

    def idle(self) -> int: ...

    def reclaim(self) -> bool: ...


class _Ready:
    """A completed event, for overlapped scheduling on a device that is synchronous anyway."""

    def synchronize(self) -> None:
        pass


@dataclass(eq=False)
class _Launched:
    requests: list[_Request]  # whose ids the step produced, in order
    ids: "torch.Tensor | list[int]"  # pinned host tensor the ids are copied into (or the ids, on CPU)
    ready: "torch.cuda.Event | _Ready | None"  # recorded after the copy; None: the ids are here already


@dataclass
class SchedulerStats:
    """Counters since the scheduler started (for monitoring)."""

    requests_submitted: int = 0
    requests_finished: dict[str, int] = field(default_factory=lambda: collections.Counter())
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_rows: int = 0  # sessions decoded, summed over the steps (rows / steps: the mean batch)
    prefill_chunks: int = 0


class Scheduler:
    """Admission, chunked prefill, batched decode and streaming for one Engine (see the module doc).

    Create through `Engine.load` (its ``prefill_chunk``, ``max_queue`` and ``max_batch``
    options) and use `Engine.submit`; the loop thread starts at the first request and stops
    with the engine.
    """

    def __init__(self, engine: "Engine", *, prefill_chunk: int, max_queue: int | None, max_batch: int | None) -> None:
        """``reclaimer`` (settable later): when a waiting request needs a row and none is free, its
        ``reclaim()`` is called under the engine lock to close an idle session (e.g. a cached
        conversation) and says whether it did; its ``idle()`` counts the sessions it could close."""
        if prefill_chunk < 1:
            raise InputError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if max_queue is not None and max_queue < 0:
            raise InputError(f"max_queue must be >= 0, got {max_queue}")
        if max_batch is not None and max_batch < 1:
            raise InputError(f"max_batch must be >= 1, got {max_batch}")
        self.engine = engine
        self.prefill_chunk, self.max_queue, self.max_batch = prefill_chunk, max_queue, max_batch
        self.stats = SchedulerStats()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []  # admitted, in admission order
        self._rotation = 0  # where the next decode step starts when max_batch cuts the batch
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._next_id = 0
        self.reclaimer: "Reclaimer | None" = None
        # Queue step t+1 before reading step t's ids (CUDA: the host's work hides behind the device's).
        # Not with recurrent state: the step queued after a stop id would advance it for good.
        self._overlap = engine.device.type == "cuda" and not engine.recurrent_state

    # -- public --------------------------------------------------------------------------------
    @property
    def overlap(self) -> bool:
        """Whether each step is queued before the previous step's ids are read (on by default on CUDA)."""
        return self._overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        if on and self.engine.recurrent_state:
            raise InputError(f"overlapped steps need state that a position can rewind; this bundle has recurrent "
                             f"state ({self.engine.recurrent_state[0]}, ...), which the extra step after a stop id "
                             "would advance for good")
        self._overlap = bool(on)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
               session: "Session | None" = None, stop_ids: Sequence[int] | None = None,
               encode_inputs: Sequence[torch.Tensor] | None = None, keep_session: bool = False) -> TokenStream:
        """Queue a request; returns its stream at once. Checks everything it can before queueing.

        ``session``: continue that session's state (it stays open afterwards); otherwise a row is
        taken when one is free and released when the request ends, unless ``keep_session``: then
        the session (``stream.session``) stays open with the conversation and the caller closes it. ``stop_ids`` (default: the
        model's eos ids) end the request after being emitted. ``encode_inputs`` run through the
        encode method on the row before the prompt (e.g. audio features for a speech model).
        Raises InputError / PromptTooLongError for bad input, QueueFullError when ``max_queue``
        requests already wait, EngineClosedError after close.
        """
        eng = self.engine
        eng._check_open()
        params = params or SamplingParams()
        ids = eng.check_token_ids(prompt_ids)
        if not ids:
            raise InputError("prompt is empty; give at least one token")
        start = 0
        if session is not None:
            session._check_open()
            if session.engine is not eng:
                raise InputError(f"session {session.id} belongs to another engine")
            if session._stream is not None and not session._stream.done:
                raise InputError(f"session {session.id} already has a request running; wait for it to finish or "
                                 "cancel it, or open another session")
            start = session.position
        if start + len(ids) > eng.max_seq_len:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens after {start} already in the session exceeds max_seq_len={eng.max_seq_len}; "
                "shorten the prompt, reset the session, or export the bundle with a larger --max-seq-len")
        if encode_inputs is not None:
            encode_inputs = tuple(encode_inputs)
            eng.method(eng.role_method("encode")).check_inputs(encode_inputs)
        stop = frozenset(eng.eos_token_ids if stop_ids is None else stop_ids)
        with self._cond:
            if self._stopping:
                raise EngineClosedError("this Engine is closed; load the bundle again with Engine.load")
            if self.max_queue is not None and session is None and self._backlog() >= self.max_queue:
                raise QueueFullError(f"{self._backlog()} requests already wait for a free row (max_queue="
                                     f"{self.max_queue}); retry later, or load the engine with a larger max_queue")
            stream = TokenStream(self._next_id, ids, params)
            self._next_id += 1
            stream._scheduler = self
            req = _Request(stream, ids, params, stop, session, own_session=session is None, encode_inputs=encode_inputs,
                           keep_session=keep_session)
            if session is not None:
                session._stream = stream
                stream.session = session
            self._waiting.append(req)
            self.stats.requests_submitted += 1
            self._ensure_thread()
            self._cond.notify_all()
        return stream

    def _backlog(self) -> int:
        """Queued requests that no free row will take at the next admission (caller holds _cond).

        Requests the loop has not admitted yet while rows are free are not waiting for a row:
        counting them would refuse a burst that fits the pool (three at once into two rows
        and a queue of two got a 429 when no loop iteration ran between the submits).
        """
        need_row = sum(1 for r in self._waiting if r.own_session and not r.stream._cancel_requested)
        return max(0, need_row - self.engine._pool.free_rows)

    def stop(self) -> None:
        """End the loop: every queued or running request finishes as "cancelled"; joins the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            atexit.unregister(self._exit_hook)
            if self._thread is not threading.current_thread():
                self._thread.join()
        self._thread = None
        with self.engine._lock:
            for req in list(self._waiting) + list(self._running):
                self._retire(req, "cancelled", EngineClosedError("the engine was closed while the request ran"))
            self._waiting.clear()

    # -- the loop --------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="onecopy-scheduler", daemon=True)
            self._thread.start()
            # An engine left open at exit: end the loop before the interpreter tears down the
            # runtime under a thread that ran kernels (seen: C++ terminate in OpenMP teardown).
            atexit.register(self._exit_hook)

    def _exit_hook(self) -> None:
        self.engine.close()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _has_work(self) -> bool:
        if self._running:
            return True
        free = self.engine._pool.free_rows
        if free == 0 and self.reclaimer is not None and self.reclaimer.idle() and any(r.own_session for r in self._waiting):
            return True  # an idle session can make room
        return any(r.stream._cancel_requested or not r.own_session or free > 0 for r in self._waiting)

    def _loop(self) -> None:
        pending: _Launched | None = None  # a step whose ids are still on their way to the host
        while True:
            with self._cond:
                while not self._stopping and pending is None and not self._has_work():
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                with self.engine._lock:
                    launched = self._launch()
                    if pending is not None:
                        self._complete(pending)
                    pending = None
                    if launched is not None and launched.ready is None:
                        self._complete(launched)  # synchronous device (CPU): nothing to overlap
                    else:
                        pending = launched
            except BaseException as e:  # never let the loop die: fail what was running, keep serving
                pending = None
                with self.engine._lock:
                    for req in list(self._running):
                        self._retire(req, "error", e)

    def _launch(self) -> "_Launched | None":
        """Queue one iteration's device work (prefill chunk, decode step, sampling, the copy of the ids).

        On CUDA it returns before the ids reach the host, so the next iteration is queued while this
        one runs; a request that stops on a stop id is therefore decoded once more, and that extra
        step is dropped (its position is set back when it retires).
        """
        self._drop_cancelled()
        self._admit()
        if not self._running:
            return None
        eng = self.engine
        sample: list[tuple[_Request, torch.Tensor, int]] = []  # (request, logits [n, V], row in logits)
        has_prefill = eng.has_prefill
        if has_prefill:
            req = next((r for r in self._running if r.reading_prompt), None)
            if req is not None:
                chunk = req.prompt[req.fed:req.fed + self.prefill_chunk]
                logits = eng._prefill_chunk(req.session, chunk)
                req.fed += len(chunk)
                self.stats.prefill_chunks += 1
                if not req.reading_prompt:
                    sample.append((req, logits, 0))
        step = [r for r in self._running if not r.exhausted and (not r.reading_prompt and r.launched > 0
                                                                  or (not has_prefill and r.reading_prompt))]
        if self.max_batch is not None and len(step) > self.max_batch:
            k = self._rotation % len(step)
            step = (step[k:] + step[:k])[:self.max_batch]
            self._rotation += self.max_batch
        # Step rows whose logits get sampled: all but those with more prompt to feed after this token.
        sampled = [(i, r) for i, r in enumerate(step) if not r.reading_prompt or r.fed + 1 == len(r.prompt)]
        # Positions after this iteration: the prefilled request's is final, the step rows advance by one.
        plan_rows = [(r, r.session.position) for r, _, _ in sample] + [(r, r.session.position + 1) for _, r in sampled]
        plan = None
        if plan_rows:
            plan = eng._sampler.plan([r.session.row for r, _ in plan_rows], [p for _, p in plan_rows],
                                     [r.launched == 0 for r, _ in plan_rows])
        if step:
            fed = [(r.session.row, r.prompt[r.fed]) for r in step if r.reading_prompt]
            if fed:
                eng._set_last_tokens([row for row, _ in fed], [t for _, t in fed])
            logits = eng._decode([r.session.row for r in step], [r.session.position for r in step])
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(step)
            for r in step:
                r.session.position += 1
                if r.reading_prompt:
                    r.fed += 1
            sample += [(r, logits, i) for i, r in sampled]
        if not sample:
            return None
        tokens = eng._sampler.sample(self._gather_logits(sample), plan)
        eng._store_last_tokens(plan, tokens)
        for req, _, _ in sample:
            req.launched += 1
            # Known now, without the id: this was the request's last token (the stop ids wait for the id).
            req.exhausted = req.launched >= req.params.max_new_tokens or req.session.position >= eng.max_seq_len
        requests = [r for r, _, _ in sample]
        if not self.overlap:
            return _Launched(requests, tokens.tolist(), None)  # the one device-to-host copy of the step
        if tokens.device.type != "cuda":
            return _Launched(requests, tokens, _Ready())  # overlap on a synchronous device: for tests
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)  # the one device-to-host copy of the step
        ready = torch.cuda.Event()
        ready.record()
        return _Launched(requests, host, ready)

    def _complete(self, launched: "_Launched") -> None:
        """Stream the ids of a launched step and retire the requests that end with them."""
        if launched.ready is not None:
            launched.ready.synchronize()
        ids = launched.ids if isinstance(launched.ids, list) else launched.ids.tolist()
        for req, token_id in zip(launched.requests, ids):
            if req.stream.done:
                continue  # retired meanwhile (cancelled, or an extra step after its stop id)
            req.generated += 1
            self.stats.generated_tokens += 1
            req.stream._push(token_id)
            if token_id in req.stop_ids:
                self._retire(req, "stop")
            elif req.generated >= req.params.max_new_tokens or req.start + len(req.prompt) + req.generated > \
                    self.engine.max_seq_len:
                self._retire(req, "length")

    def _gather_logits(self, sample: list[tuple[_Request, torch.Tensor, int]]) -> torch.Tensor:
        """The logits rows to sample, [n, vocab], in `sample` order (usually the decode output as is)."""
        first = sample[0][1]
        if all(lg is first for _, lg, _ in sample):
            idx = [i for _, _, i in sample]
            if idx == list(range(first.shape[0])):
                return first
            return first.index_select(0, to_device(torch.tensor(idx), first.device))
        return torch.cat([lg[i:i + 1] for _, lg, i in sample])

    def _drop_cancelled(self) -> None:
        for req in [r for r in self._waiting if r.stream._cancel_requested]:
            self._waiting.remove(req)
            self._retire(req, "cancelled")
        for req in [r for r in self._running if r.stream._cancel_requested]:
            self._retire(req, "cancelled")

    def _admit(self) -> None:
        eng = self.engine
        for req in list(self._waiting):
            if req.own_session:
                if eng._pool.free_rows == 0 and not (self.reclaimer is not None and self.reclaimer.reclaim()):
                    continue  # waits for a row; requests on their own session may still go ahead
                try:
                    req.session = eng.open_session()
                except OnecopyError as e:
                    self._waiting.remove(req)
                    self._retire(req, "error", e)
                    continue
                req.session._stream = req.stream
                req.stream.session = req.session
            self._waiting.remove(req)
            self._running.append(req)
            req.admitted = True
            req.start = req.session.position
            try:
                if req.encode_inputs is not None:
                    eng._encode(req.session, req.encode_inputs)
                eng._sampler.admit(req.session.row, req.params, req.prompt)
            except BaseException as e:
                self._retire(req, "error", e)
                continue
            self.stats.prompt_tokens += len(req.prompt)

    def _retire(self, req: _Request, reason: str, error: BaseException | None = None) -> None:
        """End a request: its stream finishes and its row goes back (or its session is released)."""
        if req in self._running:
            self._running.remove(req)
        self.stats.requests_finished[reason] += 1
        session = req.session
        if session is not None:
            if req.admitted:  # undo positions fed by steps launched after the last id (overlap)
                session.position = min(session.position, req.start + len(req.prompt) + max(req.generated - 1, 0))
            if session._stream is req.stream:
                session._stream = None
            if req.admitted:
                self.engine._sampler.release(session.row)
            if req.own_session and not (req.keep_session and reason in ("stop", "length")):
                session._close_now()
        req.stream._finish(reason, error)
