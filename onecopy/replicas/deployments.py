"""The two Ray Serve deployments: `EngineReplica` (one Engine and the single server's app, per device)
and `Ingress` (HTTP in, a replica chosen by `router.SessionAffinityRouter`, the response streamed back).

A request crosses as data (`asgi.HTTPRequest`); the replica runs it through the same FastAPI app
`onecopy serve` runs, so every route and error behaves as on one GPU. The ingress adds only routing
(conversation affinity, 429 from a full replica tried elsewhere), `x-onecopy-replica`, and the
cluster-wide /health and /metrics built from the replicas' reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..runtime.config import EngineConfig
from ..serve.app import ServerConfig, create_app, read_body
from ..serve.asgi import HTTPRequest, call_asgi, lifespan
from ..serve.errors import APIError
from ..serve.responses import RESPONSE_ID_HEADER
from .affinity import ConversationAffinity, chat_messages, response_route
from .board import ReplicaBoard, ReplicaReport
from .router import AVOID, LOAD, PREFER, rank_replicas

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-onecopy-replica"
_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "responses",
              "/v1/audio/transcriptions": "transcription", "/v1/models": "models"}
_HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}


@dataclass
class ReplicaSpec:
    """What every replica loads: the bundle (a path every node can read), the engine's options (the same
    `EngineConfig` `Engine.load` and `onecopy serve` take) and the server's config. Plain data: it travels
    to the replicas' processes."""

    bundle: str
    device: str = "cpu"
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_queue=64))
    server: ServerConfig = field(default_factory=lambda: ServerConfig(model_name="onecopy"))
    report_period_s: float = 0.5


class EngineReplica:
    """One Engine on this replica's device (Ray gives it one GPU on CUDA) behind the single server's app."""

    async def __init__(self, spec: ReplicaSpec, ingress: str) -> None:
        from ..runtime.engine import Engine

        ctx = serve.get_replica_context()
        self.id, self.app_name, self.ingress = ctx.replica_id.unique_id, ctx.app_name, ingress
        self.spec = spec
        self.engine = Engine.load(spec.bundle, spec.device, spec.engine)
        self.app = create_app(self.engine, spec.server)
        self._lifespan = contextlib.AsyncExitStack()
        await self._lifespan.enter_async_context(lifespan(self.app))
        self._reporter = asyncio.create_task(self._report_forever())
        log.info("replica %s serves %s on %s (%d rows)", self.id, spec.bundle, self.engine.device,
                 self.engine.max_sessions)

    async def handle(self, request: HTTPRequest, **routing: Any) -> AsyncIterator[dict[str, Any] | bytes]:
        """Serve one HTTP request. Yields its head first ({replica, status, headers, body, more}: the
        first body part comes with it, so a whole JSON reply is one message), then further body parts.
        ``routing`` holds the router's hints (see `router`); the replica ignores them."""
        head, held, streaming = None, bytearray(), False
        async with contextlib.aclosing(call_asgi(self.app, request)) as messages:
            async for m in messages:
                if m["type"] == "http.response.start":
                    head = {"replica": self.id, "status": m["status"], "headers": m.get("headers", [])}
                    streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                    for k, v in head["headers"])
                    continue
                if m["type"] != "http.response.body":
                    continue
                more = m.get("more_body", False)
                if not streaming:  # a whole reply (JSON, an error) goes as one message: the ingress reads
                    held += m.get("body", b"")  # its status before it answers (429: another replica)
                    if not more:
                        yield {**head, "body": bytes(held), "more": False}
                        return
                elif head is not None:
                    yield {**head, "body": m.get("body", b""), "more": more}
                    head = None
                elif m.get("body"):
                    yield m["body"]
                if streaming and not more:
                    return

    def report(self) -> ReplicaReport:
        """This replica's figures now."""
        from ..runtime.memory import device_used

        e, state = self.engine, self.app.state.onecopy
        status = "failed" if e.failed else "shutting down" if (e.closed or state.shutting_down) else "ok"
        alive = not e.closed
        return ReplicaReport(
            replica=self.id, status=status, rows_total=e.max_sessions if alive else 0,
            rows_free=e.free_rows, running=e.scheduler.running, waiting=e.scheduler.waiting,
            conversations=len(state.cache) if state.cache is not None else 0,
            # a failed CUDA context refuses even cudaMemGetInfo: report nothing rather than fail the report
            device_memory_used_bytes=int(device_used(e.device, sync=False)) if alive and not e.failed else 0,
            device=str(e.device), reason=e.failed)

    async def _report_forever(self) -> None:
        ingress = serve.get_deployment_handle(self.ingress, self.app_name)
        while True:
            try:
                await ingress.record_replica.remote(self.report())
            except Exception as e:  # the ingress is restarting: report again next period
                log.debug("replica %s could not report: %s", self.id, e)
            await asyncio.sleep(self.spec.report_period_s)

    def check_health(self) -> None:
        """Ray Serve calls this periodically: a failed engine (a CUDA error poisons the context) makes
        the replica unhealthy, and Ray replaces it."""
        if self.engine.failed:
            raise RuntimeError(f"the engine failed: {self.engine.failed}")

    async def __del__(self) -> None:
        """Serve's graceful shutdown has drained the requests; close the conversations and the engine."""
        self._reporter.cancel()
        with contextlib.suppress(Exception):
            await serve.get_deployment_handle(self.ingress, self.app_name).forget_replica.remote(self.id)
        await self._lifespan.aclose()
        await asyncio.to_thread(self.engine.close)


@dataclass
class IngressSpec:
    """The ingress's own settings (the rest is the replicas')."""

    max_body_bytes: int = 4 << 20
    conversation_ttl_s: float = 600.0
    retry_after_s: int = 1


class Ingress:
    """HTTP in; each request goes to a replica through Serve's router, the response streams back."""

    def __init__(self, replicas: DeploymentHandle, spec: IngressSpec) -> None:
        self.replicas, self.spec = replicas, spec
        self.affinity = ConversationAffinity(ttl_s=spec.conversation_ttl_s)
        self.board = ReplicaBoard()
        self.registry = CollectorRegistry()
        self.requests = Counter("onecopy_requests", "Requests by endpoint and HTTP status (at the ingress)",
                                ["endpoint", "status"], registry=self.registry)
        self.registry.register(self.board)
        self._routed_since_report: dict[str, int] = {}  # requests sent to each replica since its last report
        self.in_flight = 0  # HTTP requests not answered in full yet
        self.draining = False

    # -- what the replicas call --------------------------------------------------------------------
    def record_replica(self, report: ReplicaReport) -> None:
        self.board.report(report)
        self._routed_since_report.pop(report.replica, None)

    def _count_routed(self, replica: str | None, n: int) -> None:
        if replica is not None:
            self._routed_since_report[replica] = self._routed_since_report.get(replica, 0) + n

    def loads(self) -> dict[str, float]:
        """Each replica's load as routing sees it: rows in use (kept conversations too) and waiting
        requests at its last report, plus what was sent to it since (reports come twice a second;
        requests faster)."""
        return {r["replica"]: r["rows_total"] - r["rows_free"] + r["waiting"] + self._routed_since_report.get(r["replica"], 0)
                for r in self.board.live()}

    def forget_replica(self, replica: str) -> None:
        self.board.remove(replica)

    def drain(self) -> int:
        """Refuse new requests (503, /health says "shutting down") and say how many are still in flight:
        SIGTERM calls this until none is, then shuts Serve down, as the single server drains."""
        self.draining = True
        return self.in_flight

    # -- HTTP --------------------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/health" and request.method == "GET":
            status, body = self.board.health()
            if self.draining:
                status, body = 503, {**body, "status": "shutting down"}
            return JSONResponse(body, status_code=status)
        if path == "/metrics" and request.method == "GET":
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
        endpoint = _ENDPOINTS.get(path, "other")
        if self.draining:
            return self._error(endpoint, APIError(503, "the server is shutting down; retry on another server",
                                                  type="server_error", code="shutting_down",
                                                  headers={"Retry-After": str(self.spec.retry_after_s)}))
        self.in_flight += 1
        streaming = False
        try:
            response = await self._serve(request, path, endpoint)
            streaming = isinstance(response, StreamingResponse)
            return response
        finally:
            if not streaming:  # a stream is counted down when its last part went out (`_relay`)
                self.in_flight -= 1

    async def _serve(self, request: Request, path: str, endpoint: str) -> Response:
        try:
            body = await read_body(request, self.spec.max_body_bytes)
        except APIError as e:
            return self._error(endpoint, e)
        messages, continues = None, None
        if path == "/v1/chat/completions" or path.startswith("/v1/responses"):
            with contextlib.suppress(ValueError):
                parsed = json.loads(body) if body else None
                messages = chat_messages(parsed) if path == "/v1/chat/completions" else None
                continues = response_route(path, parsed)
        http = HTTPRequest(request.method, path, request.url.query.encode(), list(request.headers.raw), body)
        prefer = (self.affinity.replica_for(messages) if messages else
                  self.affinity.replica_of_response(continues) if continues else None)
        try:
            # A turn on (or a read of) a stored response must reach the replica that stores it: its 429 is the
            # answer (the client retries), not a 404 from another replica.
            head, parts = await self._route(http, prefer, sticky=continues is not None and prefer is not None)
        except APIError as e:
            return self._error(endpoint, e)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head["headers"] if k.lower() not in _HOP_HEADERS}
        if head["status"] == 200:
            if messages:
                self.affinity.remember(messages, head["replica"])
            if RESPONSE_ID_HEADER in headers:  # a Responses API turn: its state is kept where it was answered
                self.affinity.remember_response(headers[RESPONSE_ID_HEADER], head["replica"])
        headers[REPLICA_HEADER] = head["replica"]
        if not head["more"]:
            self.requests.labels(endpoint, str(head["status"])).inc()
            return Response(head["body"], status_code=head["status"], headers=headers)
        sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self._relay(head, parts, sse, endpoint), status_code=head["status"], headers=headers)

    async def _route(self, http: HTTPRequest, prefer: str | None,
                     sticky: bool = False) -> tuple[dict[str, Any], DeploymentResponseGenerator]:
        """Send ``http`` to a replica; its head and the rest of its parts. A replica that answers 429
        is avoided and the next one tried (unless ``sticky``: the preferred replica's 429 is the answer);
        when every replica is full the last 429 (with its Retry-After) is the answer. A replica that dies
        before answering is dropped by the router and the request goes to another."""
        avoid: list[str] = []
        full = None
        for _ in range(3 + max(len(self.board.replicas()), 1)):
            # The target is chosen here, where requests in flight are counted the moment they are sent
            # (reports lag by up to a period); the router honours it while it lives, else goes by load.
            loads = self.loads()
            order = rank_replicas(list(loads), prefer, set(avoid), loads)
            target = order[0] if order else prefer
            self._count_routed(target, +1)
            parts = self.replicas.options(stream=True).handle.remote(
                http, **{PREFER: target, AVOID: list(avoid), LOAD: loads})
            try:
                head = await parts.__anext__()
            except Exception as e:  # the replica died (or is shutting down) before it answered
                self._count_routed(target, -1)
                log.warning("a replica failed before answering %s (%s); trying another", http.path, e)
                await asyncio.sleep(0.05)
                continue
            if head["replica"] != target:
                self._count_routed(target, -1)
                self._count_routed(head["replica"], +1)
            if head["status"] == 429 and sticky and head["replica"] == prefer:
                self._count_routed(head["replica"], -1)
                return head, None  # type: ignore[return-value]
            if head["status"] == 429:
                self._count_routed(head["replica"], -1)
                if head["replica"] in avoid:  # the router offered a full one again: all are full
                    full = head
                    break
                avoid.append(head["replica"])
                full = head
                continue
            return head, parts
        if full is not None:
            return full, None  # type: ignore[return-value]
        raise APIError(503, "no replica could take the request (they are starting or restarting); retry shortly",
                       type="server_error", code="replica_unavailable",
                       headers={"Retry-After": str(self.spec.retry_after_s)})

    async def _relay(self, head: dict[str, Any], parts: DeploymentResponseGenerator, sse: bool,
                     endpoint: str) -> AsyncIterator[bytes]:
        """The body, part by part. A replica that dies mid-stream ends an event stream with an error
        event and [DONE] (never a hang or a cut stream); a client that goes away cancels the request."""
        status, done = head["status"], False
        try:
            yield head["body"]
            async for part in parts:
                yield part
            done = True
        except Exception as e:
            status, done = 503, True
            ref = uuid.uuid4().hex[:12]
            log.error("replica %s failed mid-response (reference %s): %s", head["replica"], ref, e)
            if sse:
                err = APIError(503, f"the replica serving this request ({head['replica']}) stopped mid-response "
                                    f"(reference {ref}); send the request again: another replica takes it",
                               type="server_error", code="replica_unavailable")
                yield f"data: {json.dumps(err.body())}\n\n".encode()
                yield b"data: [DONE]\n\n"
        finally:
            if not done:
                parts.cancel()  # the client went away: the replica cancels the request and frees its row
            self.requests.labels(endpoint, str(status if done else 499)).inc()
            self.in_flight -= 1

    def _error(self, endpoint: str, e: APIError) -> Response:
        self.requests.labels(endpoint, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
