"""Calling an ASGI app in-process for one HTTP request, without a socket.

A replica of `onecopy serve --replicas` runs the very app the single server runs (`create_app`): the
request arrives as data through a Ray Serve handle, and the response goes back as messages. A consumer
that stops reading (the client went away) disconnects the request, so the app cancels it and frees
its row, exactly as a closed socket does.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable


@dataclass
class HTTPRequest:
    """One HTTP request as plain data (it crosses process boundaries)."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""

    def scope(self) -> dict[str, Any]:
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                "method": self.method, "scheme": "http", "path": self.path, "raw_path": self.path.encode(),
                "query_string": self.query, "root_path": "", "headers": list(self.headers),
                "client": ("127.0.0.1", 0), "server": ("onecopy-replica", 80)}


async def call_asgi(app: Callable, request: HTTPRequest) -> AsyncIterator[dict[str, Any]]:
    """Run ``app`` on ``request``; yields its ASGI send messages (`http.response.start`, then
    `http.response.body` ones). Closing the iterator early disconnects the request and cancels the app."""
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await sent.put(message)

    task = asyncio.ensure_future(app(request.scope(), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))  # the end of the messages
    try:
        while (message := await sent.get()) is not None:
            yield message
        task.result()  # the app's own exception, if it raised one
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


@contextlib.asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    """Run a Starlette/FastAPI app's lifespan (startup, then shutdown on exit), as a server would."""
    async with app.router.lifespan_context(app):
        yield
