"""A request's token stream: ids as they are generated, read from a thread or from asyncio.

The producer (`loop.EngineLoop`) attaches itself, pushes ids and finishes the stream; the consumer
iterates, waits for the result or cancels. Nothing here knows about sessions, rows or the device.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from ..params import SamplingParams

CANCEL_TIMEOUT = 60.0  # seconds `TokenStream.cancel` waits for the producer by default


class TokenStream:
    """The ids of one request as they are generated. Iterate it from a thread, or ``async for`` it.

    After the last id, ``finish_reason`` says why it ended: "stop" (an eos or stop id, included
    as the last id), "length" (max_new_tokens or max_seq_len), "cancelled", or "error" (iterating
    raises the error). ``cancel()`` ends it and frees its row before returning.
    """

    def __init__(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.prompt_ids, self.params = prompt_ids, params
        self.id = -1  # the request's id, given when it is queued
        self.ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.submitted = time.perf_counter()
        self.token_times: list[float] = []  # perf_counter() when each id reached the stream
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._cancel: Callable[[], None] | None = None  # asks the producer to end the request
        self._on_producer_thread: Callable[[], bool] = lambda: False
        self.session: Any = None  # the session it ran on (`session.Session`); the caller's to close with keep_session
        self.cached_tokens = 0  # prompt tokens found in the prefix cache (not prefilled), known at admission

    # -- producer side --------------------------------------------------------------------------
    def attach(self, cancel: Callable[[], None], on_producer_thread: Callable[[], bool]) -> None:
        """Connect the producer: ``cancel()`` asks it to end the request (it then finishes the stream);
        ``on_producer_thread()`` tells `cancel` not to wait on the thread that would finish it."""
        self._cancel, self._on_producer_thread = cancel, on_producer_thread

    def push(self, token_id: int) -> None:
        """One more id."""
        with self._cond:
            self.ids.append(token_id)
            self.token_times.append(time.perf_counter())
            self._cond.notify_all()
        self._wake_async()

    def finish(self, reason: str, error: BaseException | None = None) -> None:
        """The last call: why the request ended (and its error). Later calls change nothing."""
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
        """Stop generating. With ``wait`` (and off the producer's thread) the request's row is free when
        this returns True; without, within one iteration (for callers that must not block, like an event
        loop). False: it had not ended after ``timeout`` s (a step still runs); its row stays taken
        until it has."""
        if self.done:
            return True
        if self._cancel is None:
            self.finish("cancelled")
            return True
        self._cancel()
        if wait and not self._on_producer_thread():
            with self._cond:
                return self._cond.wait_for(lambda: self.finish_reason is not None, timeout=timeout)
        return self.done
