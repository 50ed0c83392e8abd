"""Running the app: in the foreground (`onecopy serve`, SIGTERM drains within a grace period) or in a
background thread on a free loopback port (tests, `onecopy bench serve`)."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable

import uvicorn

from ..runtime.engine import Engine
from .app import ServerConfig, create_app


def _uvicorn(engine: Engine, config: ServerConfig, host: str, port: int, grace_s: float, log_level: str) -> uvicorn.Server:
    app = create_app(engine, config)
    # In-flight streams get grace_s to finish after SIGTERM; then uvicorn cancels them, which cancels
    # their requests and frees their rows.
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                         timeout_graceful_shutdown=grace_s, access_log=False))


def serve(engine: Engine, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 10.0,
          log_level: str = "info", listening: Callable[[str], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then drain, close the engine and return (a clean exit, status 0).
    ``listening`` gets the base URL once the port is bound (port 0: the one the OS picked)."""
    # uvicorn drains on the signal and then raises it again for the handler it found: make that one a
    # no-op, so the process ends through our own cleanup rather than by the signal.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))  # bound here, so that the URL named is the one served (port 0 included)
            if listening is not None:
                listening(f"http://{host}:{sock.getsockname()[1]}")
            _uvicorn(engine, config, host, port, grace_s, log_level).run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.close()


class BackgroundServer:
    """The server on a thread, bound to a free port of ``host``. A context manager; ``url`` is its base URL.

    The engine stays the caller's: stopping the server does not close it.
    """

    def __init__(self, engine: Engine, config: ServerConfig, host: str = "127.0.0.1", grace_s: float = 5.0) -> None:
        self.server = _uvicorn(engine, config, host, 0, grace_s, "warning")
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="onecopy-http", daemon=True)

    @property
    def app(self):
        return self.server.config.app

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)

    def __exit__(self, *exc: object) -> None:
        self.stop()
