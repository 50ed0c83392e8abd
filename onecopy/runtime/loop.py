"""The engine loop: the thread that drives the scheduler and the model runner, and the streams it feeds.

Each iteration, under the engine's lock: admit (the runner sets each admitted request up), plan a
step, execute it, then take the ids of the step before (overlapped: on CUDA step t+1 is queued before
step t's ids are read, so the host's work hides behind the device's) or of this one, stream them, and
end the requests that finished (their rows go back at once).

A step that raises ends the requests of that step with "error" and a `StepFailedError` naming the
cause; the engine keeps serving. A CUDA error leaves the context unusable (sticky): the engine is
marked failed, every request ends, and new ones get `EngineFailedError` naming the cause.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

from ..errors import EngineClosedError, EngineFailedError, InputError, StepFailedError
from ..sampling import SamplingParams
from .runner import Launched, ModelRunner
from .scheduler import Request, Scheduler

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("onecopy.loop")

CANCEL_TIMEOUT = 60.0  # seconds `TokenStream.cancel` waits for the loop by default


def is_device_fatal(error: BaseException) -> bool:
    """Whether ``error`` leaves the device context unusable (CUDA errors are sticky)."""
    text = str(error)
    return "CUDA error" in text or "CUBLAS_STATUS" in text or "cudaErrorIllegalAddress" in text


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
        self._request: Request | None = None
        self._loop: EngineLoop | None = None
        self.session: "Session | None" = None  # the session it ran on; the caller's to close with keep_session
        self.cached_tokens = 0  # prompt tokens found in the prefix cache (not prefilled), known at admission

    # -- producer side (the engine loop) ---------------------------------------------------------
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

    def cancel(self, wait: bool = True, timeout: float = CANCEL_TIMEOUT) -> bool:
        """Stop generating. With ``wait`` (and off the loop thread) the request's row is free when this
        returns True; without, within one iteration (for callers that must not block, like an event
        loop). False: it had not ended after ``timeout`` s (a step still runs); its row stays taken
        until it has."""
        if self.done:
            return True
        loop = self._loop
        if loop is None or self._request is None:
            self._finish("cancelled")
            return True
        self._request.cancel_requested = True
        loop.wake()
        if wait and not loop.on_loop_thread():
            with self._cond:
                return self._cond.wait_for(lambda: self.finish_reason is not None, timeout=timeout)
        return self.done


class EngineLoop:
    """The thread that serves every request of one engine (see the module doc). Starts at the first request."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, lock: threading.RLock, *,
                 on_finished: Callable[[Request], None], overlap: bool, recurrent_state: bool) -> None:
        self.scheduler, self.runner, self.lock = scheduler, runner, lock
        self._on_finished = on_finished  # releases the request's row (the engine's part)
        self._overlap = overlap
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._next_id = 0
        self.failed: str | None = None  # why the engine can serve no more (a sticky device error)
        self.recurrent_state = recurrent_state  # overlap would advance such state for good

    # -- public ---------------------------------------------------------------------------------
    @property
    def overlap(self) -> bool:
        """Whether each step is queued before the previous step's ids are read (on by default on CUDA)."""
        return self._overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        if on and self.recurrent_state:
            raise InputError("overlapped steps need state that a position can rewind; this bundle has recurrent "
                             "state, which the extra step after a stop id would advance for good")
        self._overlap = bool(on)

    def submit(self, req: Request) -> TokenStream:
        """Queue a checked request with the scheduler; its stream, at once."""
        with self._cond:
            if self.failed:
                raise EngineFailedError(f"the engine failed and serves no more requests: {self.failed}; "
                                        "load the bundle again in a new process")
            if self._stopping:
                raise EngineClosedError("this Engine is closed; load the bundle again with Engine.load")
            busy = req.session._stream if req.session is not None else None
            if busy is not None and not busy.done:
                raise InputError(f"session {req.session.id} already has a request running; wait for it to finish or "
                                 "cancel it, or open another session")
            stream = TokenStream(self._next_id, req.prompt, req.params)
            req.id, req.stream = self._next_id, stream
            stream._request, stream._loop = req, self
            self.scheduler.add(req)  # QueueFullError leaves nothing queued
            self._next_id += 1
            if req.session is not None:
                req.session._stream = stream
                stream.session = req.session
            self._ensure_thread()
            self._cond.notify_all()
        log.debug("request %d queued (%d prompt tokens)", req.id, len(req.prompt))
        return stream

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

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
        with self.lock:
            self.scheduler.finish_all("cancelled", EngineClosedError("the engine was closed while the request ran"))
            self._retire_finished()

    # -- the loop --------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="onecopy-loop", daemon=True)
            self._thread.start()
            # An engine left open at exit: end the loop before the interpreter tears down the
            # runtime under a thread that ran kernels (seen: C++ terminate in OpenMP teardown).
            atexit.register(self._exit_hook)

    def _exit_hook(self) -> None:
        self.stop()

    def _run(self) -> None:
        pending: Launched | None = None  # a step whose ids are still on their way to the host
        while True:
            with self._cond:
                while not self._stopping and pending is None and not self.scheduler.has_work():
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                with self.lock:
                    launched = self._launch()
                    if pending is not None:
                        self._complete(pending)
                    pending = None
                    if launched is not None and launched.ready is None:
                        self._complete(launched)  # synchronous (CPU, or overlap off): nothing to overlap
                    else:
                        pending = launched
                    self._retire_finished()
            except BaseException as e:  # never let the loop die on a step: fail what was running
                pending = None
                self._step_failed(e)
                if self.failed:
                    return  # the device is unusable: nothing more runs (submit refuses new requests)

    def _launch(self) -> Launched | None:
        for req in self.scheduler.admit():
            req.session._stream, req.stream.session = req.stream, req.session  # a row opened for it
            try:
                self.runner.start(req)
                log.debug("request %d admitted on row %d", req.id, req.session.row)
            except BaseException as e:
                self.scheduler.finish(req, "error", StepFailedError(f"request {req.id} could not start: {e}"))
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        return self.runner.execute(plan, overlap=self.overlap)

    def _complete(self, launched: Launched) -> None:
        for req, token_id in self.scheduler.update(launched.plan, launched.host_ids()):
            req.stream._push(token_id)

    def _retire_finished(self) -> None:
        """Give back the rows of the requests that ended, then end their streams (in that order: a
        caller woken by the stream finds the row free)."""
        for req in self.scheduler.take_finished():
            try:
                if req.admitted:
                    self.runner.release(req.session.row)
                self._on_finished(req)
            except BaseException:  # a broken device may refuse even this; the stream must still end
                log.exception("releasing the row of request %d failed", req.id)
            req.stream._finish(req.finish_reason, req.error)
            log.debug("request %d finished: %s", req.id, req.finish_reason)

    def _step_failed(self, error: BaseException) -> None:
        fatal = is_device_fatal(error)
        if fatal:
            self.failed = f"{type(error).__name__}: {error}"
            log.error("device error, the engine stops serving: %s", self.failed)
        else:
            log.exception("a step failed; its requests end with an error", exc_info=error)
        wrapped = (EngineFailedError if fatal else StepFailedError)(
            f"the step running this request failed: {type(error).__name__}: {error}")
        with self.lock:
            if fatal:
                self.scheduler.finish_all("error", wrapped)
            else:
                self.scheduler.fail_running(wrapped)
            self._retire_finished()
