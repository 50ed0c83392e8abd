"""The engine loop: the thread that drives the scheduler and the model runner and feeds the streams.

Each iteration, under the engine's lock: admit (the engine gives each admitted request its session
handle), plan a step, execute it, then take the ids of the step before (overlapped: on CUDA step t+1
is queued before step t's ids are read, so the host's work hides behind the device's) or of this
one, stream them, and end the requests that finished (their rows went back when they finished).

Fail closed: anything a step raises leaves the device in an unknown state (a CUDA error is sticky, a
kernel fault inside an AOTI package surfaces as a bare "API call failed"), so the engine is marked
failed: every waiting and running request ends with `EngineFailedError`, new requests get it too,
the raw error goes to the log under a reference that the error's message names.
"""

from __future__ import annotations

import atexit
import logging
import threading
import uuid
from collections.abc import Callable

from ..errors import EngineClosedError, EngineFailedError, InputError
from .request import Request
from .runner import Launched, ModelRunner
from .scheduler import Scheduler
from .stream import TokenStream
from .turn_lock import TurnLock

log = logging.getLogger(__name__)


class EngineLoop:
    """The thread that serves every request of one engine (see the module doc). Starts at the first request.

    ``on_admitted(req)`` and ``on_finished(req)`` are the engine's (host bookkeeping only), called under
    the lock: a request got its row; a request ended (before its stream finishes).
    """

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, lock: TurnLock, *,
                 on_admitted: Callable[[Request], None], on_finished: Callable[[Request], None], overlap: bool,
                 recurrent_state: bool) -> None:
        self.scheduler, self.runner, self.lock = scheduler, runner, lock
        self._on_admitted, self._on_finished = on_admitted, on_finished
        self._overlap = overlap
        self._intake = threading.Lock()  # orders submits against stop and failure
        self._kick = threading.Event()  # set when there may be work: the idle thread wakes
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._next_id = 0
        self.failed: str | None = None  # why the engine serves no more (a stable message; the log has the cause)
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

    def failure(self) -> EngineFailedError:
        """The error that requests and calls get once the engine has failed."""
        return EngineFailedError(f"the engine failed and serves no more requests ({self.failed}); load the bundle "
                                 "again in a new process")

    def submit(self, req: Request) -> TokenStream:
        """Queue a checked request (its ``stream`` set) with the scheduler; returns the stream."""
        stream: TokenStream = req.stream
        with self._intake:
            if self.failed:
                raise self.failure()
            if self._stopping:
                raise EngineClosedError("this Engine is closed; load the bundle again with Engine.load")
            req.id = stream.id = self._next_id
            stream.attach(lambda: self._cancel(req), self.on_loop_thread)
            self.scheduler.add(req)  # QueueFullError leaves nothing queued
            self._next_id += 1
            self._ensure_thread()
        self._kick.set()
        log.debug("request %d queued (%d prompt tokens)", req.id, len(req.prompt))
        return stream

    def wake(self) -> None:
        self._kick.set()

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def fail(self, error: BaseException) -> EngineFailedError:
        """A device call raised (here or in a session's direct call): the engine serves no more. Every
        request ends with the returned error (its ``__cause__`` is ``error``); the log gets the details."""
        with self._intake:
            first = self.failed is None
            if first:
                ref = uuid.uuid4().hex[:12]
                self.failed = f"a device call failed; reference {ref} in the log"
        if first:
            log.error("engine failed (reference %s): %s: %s", ref, type(error).__name__, error, exc_info=error)
        failure = self.failure()
        failure.__cause__ = error
        with self.lock:
            try:
                self.scheduler.finish_all("error", failure)
                self._retire_finished()
            except Exception:  # the host's bookkeeping broke with the device: every stream has ended anyway
                log.exception("ending the requests of the failed engine (reference in the error above)")
        self._kick.set()  # the thread sees `failed` and ends
        return failure

    def stop(self) -> None:
        """End the loop: every queued or running request finishes as "cancelled"; joins the thread."""
        with self._intake:
            self._stopping = True
            thread, self._thread = self._thread, None
        self._kick.set()
        if thread is not None:
            atexit.unregister(self.stop)
            if thread is not threading.current_thread():
                thread.join()
        with self.lock:
            self.scheduler.finish_all("cancelled", EngineClosedError("the engine was closed while the request ran"))
            self._retire_finished()

    # -- the loop --------------------------------------------------------------------------------
    def _cancel(self, req: Request) -> None:
        req.cancel_requested = True
        self._kick.set()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="onecopy-loop", daemon=True)
            self._thread.start()
            # An engine left open at exit: end the loop before the interpreter tears down the runtime
            # under a thread that ran kernels (seen: C++ terminate in OpenMP teardown).
            atexit.register(self.stop)

    def _run(self) -> None:
        pending: Launched | None = None  # a step whose ids are still on their way to the host
        try:
            while not (self._stopping or self.failed):
                self._kick.clear()  # before looking for work: a kick after the look wakes the wait below
                busy = False  # work was done while idle: look again before waiting (the lock let go between)
                self.lock.yield_to_waiters()  # a caller waiting for the lock (a direct call) goes first
                with self.lock:
                    work = pending is not None or self.scheduler.has_work()
                    if work:
                        launched = self._launch()
                        if pending is not None:
                            self._complete(pending)
                        pending = None
                        if launched is not None and launched.ready is None:
                            self._complete(launched)  # synchronous (CPU, or overlap off): nothing to overlap
                        else:
                            pending = launched
                        self._retire_finished()
                    else:
                        # Decisions left by the last requests, and blocks copied to the host tier ahead of
                        # their eviction (a bounded batch a pass): carried out now, while idle, not in the next
                        # request's first step.
                        ops = self.scheduler.idle_ops()
                        if ops:
                            self.runner.apply(ops)
                            busy = True
                if not (work or busy):
                    self._kick.wait()
        except Exception as e:  # the device's state is unknown now: fail closed
            self.fail(e)
        except BaseException as e:  # the thread is going down: no request may hang on it
            self.fail(e)
            raise

    def _launch(self) -> Launched | None:
        for req in self.scheduler.admit():
            self._on_admitted(req)
            log.debug("request %d admitted on row %d", req.id, req.row)
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        return self.runner.execute(plan, overlap=self.overlap)

    def _complete(self, launched: Launched) -> None:
        for req, token_id in self.scheduler.update(launched.plan, launched.host_ids()):
            req.stream.push(token_id)

    def _retire_finished(self) -> None:
        """Hand the ended requests to the engine, then end their streams (a caller woken by the stream
        finds the row free: the scheduler gave it back when the request finished)."""
        errors = []
        for req in self.scheduler.take_finished():
            try:
                self._on_finished(req)
            except Exception as e:  # raised below, once every stream has ended
                errors.append(e)
            finally:
                req.stream.finish(req.finish_reason, req.error)
            log.debug("request %d finished: %s", req.id, req.finish_reason)
        if errors:
            raise errors[0]
