"""The OpenAI-compatible HTTP layer over an Engine's scheduler (FastAPI; streaming as server-sent events).

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (and GET /
DELETE /v1/responses/{id}, GET .../input_items: `responses`), POST /v1/audio/transcriptions (speech bundles),
GET /health, GET /metrics. Every request is one
scheduler request; this module only translates, streams and keeps finished conversations.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import EngineClosedError, EngineFailedError, InputError, OnecopyError, QueueFullError
from ..runtime.engine import Engine
from ..runtime.stream import TokenStream
from ..runtime.session import Session
from .conversations import ConversationCache
from .errors import APIError, bad_request, unavailable
from .metrics import ServerMetrics
from .protocol import GenerationRequest, check_model, parse_generation, parse_json
from .responses import (DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_STORED, RESPONSE_ID_HEADER, ResponseStore, ResponsesRun,
                        StoredResponse, input_items_page, not_found, parse_response_request)
from .text import ReplyText
from .tools import Arguments, CallFailed, CallParser, CallStart, Event, Text, parse_reply

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """How the server behaves (the CLI's options)."""

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 << 20  # requests larger than this get 413 (audio uploads included)
    conversation_cache: bool = True
    conversation_ttl_s: float = 600.0
    max_conversations: int | None = None  # None: as many as there are rows (reclaimed when rows are needed)
    max_stored_responses: int = DEFAULT_MAX_STORED  # /v1/responses kept in memory for previous_response_id and GET
    state_dir: str | None = None  # where stored responses also go, to outlive the process (`responses.ResponseStore`)
    max_state_bytes: int = DEFAULT_MAX_FILE_BYTES  # response files kept in state_dir (least recently written go first)
    retry_after_s: int = 1


@dataclass
class _Generation:
    """One generation request in flight: its stream, text state and who owns the session afterwards."""

    state: "ServerState"
    req: GenerationRequest
    stream: TokenStream
    reused: int
    reply: ReplyText
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    calls: CallParser | None = None  # a reply parsed for tool calls (the request's tools are active)

    def __post_init__(self) -> None:
        tools = self.req.tools
        if tools is not None and tools.active:
            # a constrained reply's calls stream their arguments as generated (the grammar keeps them valid); a
            # free reply's come whole once their block is settled, and a free reply of bare JSON calls (Llama 3.1's
            # form) is read at its end
            free = self.req.params.grammar is None
            self.calls = CallParser(tools.names(), eager=not free, params=tools.parameters(), bare=free)

    def finish_reason(self, called: bool | None = None) -> str:
        """OpenAI's reason for a reply that ended well (a failed one is `failure`'s): "tool_calls" when it ended
        with tool calls (``called``; default: the streamed reply's parser has some)."""
        if called is None:
            called = self.calls is not None and any(c.complete for c in self.calls.calls)
        ended = self.reply.stopped or self.stream.finish_reason == "stop"
        return ("tool_calls" if called else "stop") if ended else "length"

    def reply_events(self, piece: str, last: bool = False) -> list[Event]:
        """Reply text as events: text, and tool calls when the request has tools (``last``: the reply's end)."""
        if self.calls is None:
            return [Text(piece)] if piece else []
        return self.calls.push(piece) + (self.calls.flush() if last else [])

    def chat_delta(self, event: Event) -> dict[str, Any] | None:
        """A stream chunk's delta for ``event``, as OpenAI streams tool calls (id, type and name first, then the
        arguments in pieces)."""
        if isinstance(event, (Text, CallFailed)):  # a call already sent that is no call: its text as content
            return {"content": event.text}
        if isinstance(event, CallStart):
            return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        if isinstance(event, Arguments):
            return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
        return None  # a call's end: nothing to send

    def failure(self, error: BaseException | None = None) -> APIError | None:
        """The error to send when the request did not end well (cancelled or failed), else None."""
        s = self.stream
        if error is None and (self.reply.stopped or s.finish_reason not in ("cancelled", "error")):
            return None
        error = error or s.error
        if isinstance(error, (EngineClosedError, EngineFailedError)):
            return unavailable(error)
        if isinstance(error, OnecopyError):
            return APIError(500, str(error), type="server_error")
        if error is not None:
            log.error("request %s failed", self.id, exc_info=error)
            return APIError(500, f"the request failed inside the server (request id {self.id}; the server log has "
                                 "the details)", type="server_error")
        return APIError(500, f"the request was {s.finish_reason} before it finished", type="server_error")

    def usage(self) -> dict[str, int]:
        prompt = len(self.req.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": len(self.stream.ids),
                "total_tokens": prompt + len(self.stream.ids),
                # held by a kept conversation or found in the prefix cache: not prefilled
                "prompt_tokens_details": {"cached_tokens": self.reused + self.stream.cached_tokens}}

    def settle(self) -> None:
        """After the request (blocking: run in a thread): stop it if still running, then keep the
        finished conversation in the cache or close the session."""
        stream, cache = self.stream, self.state.cache
        if not stream.done:
            stream.cancel()
        session: Session | None = stream.session
        if session is None or session.closed:
            return
        tokens = self.req.prompt_ids + stream.ids[:-1]  # the last id was sampled, never fed
        reusable = (cache is not None and stream.finish_reason in ("stop", "length") and not self.reply.stopped
                    and session.position == len(tokens) < self.state.engine.max_seq_len)
        if reusable:
            cache.put(session, tokens)
        else:
            session.close()

    def chunk(self, delta: dict[str, Any] | str | None, finish: str | None = None) -> str:
        if self.req.kind == "chat":
            choice = {"index": 0, "delta": delta if delta is not None else {}, "logprobs": None, "finish_reason": finish}
            obj = {"id": f"chatcmpl-{self.id}", "object": "chat.completion.chunk", "created": self.created,
                   "model": self.state.config.model_name, "choices": [choice]}
        else:
            obj = {"id": f"cmpl-{self.id}", "object": "text_completion", "created": self.created,
                   "model": self.state.config.model_name,
                   "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]}
        if self.req.include_usage:
            obj["usage"] = None
        return f"data: {json.dumps(obj)}\n\n"

    def delta_chunks(self, piece: str, last: bool = False) -> list[str]:
        """The stream chunks of a piece of the reply."""
        if self.req.kind != "chat":
            return [self.chunk(piece)] if piece else []
        deltas = (self.chat_delta(e) for e in self.reply_events(piece, last))
        return [self.chunk(d) for d in deltas if d is not None]

    async def events(self) -> AsyncIterator[str]:
        """The SSE stream; a client that goes away cancels the request (its row frees within an iteration)."""
        loop = asyncio.get_running_loop()
        finished, status = False, 200
        try:
            if self.req.kind == "chat":
                yield self.chunk({"role": "assistant", "content": ""})
            failed = None
            try:
                async for token_id in self.stream:
                    piece = self.reply.push(token_id)
                    for chunk in self.delta_chunks(piece):
                        yield chunk
                    if self.reply.stopped:
                        break
            except Exception as e:  # the stream raises its request's error: an error event, then [DONE]
                failed = self.failure(e)
            failed = failed or self.failure()
            if failed is not None:
                yield f"data: {json.dumps(failed.body())}\n\n"
                yield "data: [DONE]\n\n"
                finished, status = True, failed.status
                return
            for chunk in self.delta_chunks(self.reply.flush(), last=True):
                yield chunk
            yield self.chunk({} if self.req.kind == "chat" else "", self.finish_reason())
            if self.req.include_usage:
                usage = {"id": f"{'chatcmpl' if self.req.kind == 'chat' else 'cmpl'}-{self.id}",
                         "object": "chat.completion.chunk" if self.req.kind == "chat" else "text_completion",
                         "created": self.created, "model": self.state.config.model_name, "choices": [],
                         "usage": self.usage()}
                yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self.stream.cancel(wait=False)  # never block the event loop; the loop frees the row
            loop.run_in_executor(None, self._settle_and_count, status if finished else 499)

    def _settle_and_count(self, status: int, endpoint: str | None = None) -> None:
        self.settle()
        self.state.count(endpoint or self.req.kind, status, self.stream, self.reused)

    async def text(self, endpoint: str) -> str:
        """The whole reply (a request answered at once), the session settled and the request counted under
        ``endpoint``; the APIError of a request that did not end well."""
        text, failed = [], None
        try:
            async for token_id in self.stream:
                text.append(self.reply.push(token_id))
                if self.reply.stopped:
                    break
        except Exception as e:
            failed = self.failure(e)
        finally:
            await run_in_threadpool(self.settle)
        failed = failed or self.failure()
        if failed is not None:
            self.state.count(endpoint, failed.status, self.stream, self.reused)
            raise failed
        text.append(self.reply.flush())
        self.state.count(endpoint, 200, self.stream, self.reused)
        return "".join(text)

    async def collect(self) -> dict[str, Any]:
        content = await self.text(self.req.kind)
        if self.req.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            called = False
            if self.calls is not None:
                parsed = parse_reply(content, self.calls.names, self.calls.params, self.calls.bare)
                message["content"] = parsed.content
                if parsed.calls:
                    message["tool_calls"] = [c.item() for c in parsed.calls]
                    called = True
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish_reason(called)}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": self.finish_reason()}
            obj = "text_completion"
        return {"id": f"{'chatcmpl' if self.req.kind == 'chat' else 'cmpl'}-{self.id}", "object": obj,
                "created": self.created, "model": self.state.config.model_name, "choices": [choice],
                "usage": self.usage()}


class ServerState:
    """What the handlers share: the engine, the config, the conversation cache, the metrics."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine, self.config = engine, config
        self.speech = "encode" in {engine.method(n).role for n in engine.methods}
        self.cache = None
        # With a prefix cache a finished chat's blocks stay published: its next turn finds them there
        # (one mechanism); bundles without paged KV keep the whole session instead.
        if config.conversation_cache and not self.speech and not engine.prefix_cache:
            self.cache = ConversationCache(config.conversation_ttl_s, config.max_conversations)
            engine.scheduler.reclaimer = self.cache
        self.metrics = ServerMetrics(engine, self.cache)
        self.responses = ResponseStore(config.max_stored_responses,
                                       Path(config.state_dir) / "responses" if config.state_dir else None,
                                       engine.manifest.fingerprint(), max_file_bytes=config.max_state_bytes)
        self.metrics.responses_stored.set_function(lambda: len(self.responses))
        self.shutting_down = False
        self._transcriber = None

    def count(self, endpoint: str, status: int, stream: TokenStream | None = None, reused: int = 0) -> None:
        self.metrics.requests.labels(endpoint, str(status)).inc()
        if stream is not None:
            self.metrics.observe(stream, reused)

    @property
    def transcriber(self):
        if self._transcriber is None:
            from ..transcribe import Transcriber

            self._transcriber = Transcriber(self.engine)
        return self._transcriber


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body; 413 (as an APIError) past ``limit`` bytes, declared or sent."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; this server takes at most {limit}",
                       code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    return bytes(body)


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``engine`` (the caller keeps ownership of the engine and closes it)."""
    state = ServerState(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def expire() -> None:
            while True:
                await asyncio.sleep(max(config.conversation_ttl_s / 4, 0.05))
                await run_in_threadpool(state.cache.expire)

        task = asyncio.create_task(expire()) if state.cache is not None else None
        yield
        state.shutting_down = True
        if task is not None:
            task.cancel()
        if state.cache is not None:
            await run_in_threadpool(state.cache.clear)

    app = FastAPI(title="onecopy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.onecopy = state

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_parameters(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return JSONResponse(bad_request(f"invalid {where or 'request'}: {first.get('msg', 'malformed')}", param=where,
                                        code="invalid_value").body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(APIError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        ref = uuid.uuid4().hex[:12]
        log.error("internal error %s on %s", ref, request.url.path, exc_info=e)
        return JSONResponse(APIError(500, f"internal server error (reference {ref}; the server log has the details)",
                                     type="server_error").body(), status_code=500)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if config.api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                what = "No API key provided" if not given else "Incorrect API key provided"
                state.count(request.url.path, 401)
                return JSONResponse(APIError(401, f"{what}: send 'Authorization: Bearer <key>' with the key the server "
                                                  "was started with (--api-key)", code="invalid_api_key").body(),
                                    status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if engine.failed:
            return JSONResponse({"status": "failed", "reason": engine.failed}, status_code=503)
        if state.shutting_down or engine.closed:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok", "rows_free": engine.free_rows, "running": engine.scheduler.running,
                             "waiting": engine.scheduler.waiting})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "onecopy", "max_model_len": engine.max_seq_len}]}

    async def start(request: Request, endpoint: str, parse: Callable[[dict[str, Any]], Any],
                    request_of: Callable[[Any], GenerationRequest] = lambda r: r) -> tuple[Any, _Generation]:
        """Parse a generation body (``parse``; ``request_of`` its GenerationRequest) and submit it, continuing the
        kept conversation its prompt starts with (chats and responses; completions leave no state); the error
        responses of every generation endpoint, counted under ``endpoint``."""
        try:
            if state.speech:
                raise bad_request(f"model '{config.model_name}' is a speech model: use /v1/audio/transcriptions",
                                  param="model")
            body = parse_json(await read_body(request, config.max_body_bytes))
            parsed = await run_in_threadpool(parse, body)  # tokenizing a long prompt, reading a stored response
            req = request_of(parsed)
            cache = state.cache if req.kind == "chat" else None
            session, reused = cache.take(req.prompt_ids) if cache is not None else (None, 0)
            try:
                stream = engine.submit(req.prompt_ids[reused:], req.params, session=session,
                                       keep_session=session is None and cache is not None,
                                       stop_ids=[] if req.ignore_eos else None)
            except BaseException:
                if session is not None:  # untouched: keep it for the next turn (off the event loop: it may evict)
                    await run_in_threadpool(state.cache.put, session, req.prompt_ids[:reused])
                raise
        except QueueFullError as e:
            state.count(endpoint, 429)
            raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(config.retry_after_s)}) from None
        except InputError as e:
            state.count(endpoint, 400)
            raise bad_request(str(e), code="invalid_value") from None
        except (EngineClosedError, EngineFailedError) as e:
            state.count(endpoint, 503)
            raise unavailable(e) from None
        except APIError as e:
            state.count(endpoint, e.status)
            raise
        return parsed, _Generation(state, req, stream, reused, ReplyText(engine.tokenizer, req.stop))

    def sse(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def generate(request: Request, kind: str) -> Response:
        _, run = await start(request, "chat" if kind == "chat" else "completion",
                             lambda body: parse_generation(body, kind, engine, config.model_name))
        return sse(run.events()) if run.req.stream else JSONResponse(await run.collect())

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        turn, run = await start(request, "responses",
                                lambda body: parse_response_request(body, engine, config.model_name, state.responses),
                                lambda turn: turn.req)
        out = ResponsesRun(run, turn, state.responses)
        head = {RESPONSE_ID_HEADER: turn.id}  # the replicas' ingress routes turns on this id here
        if turn.req.stream:
            response = sse(out.events())
            response.headers.update(head)
            return response
        return JSONResponse(await out.collect(), headers=head)

    async def stored(response_id: str) -> StoredResponse:
        entry = await run_in_threadpool(state.responses.get, response_id)  # may read its file
        if entry is None:
            state.count("responses", 404)
            raise not_found(response_id)
        return entry

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        return JSONResponse((await stored(response_id)).body)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        await stored(response_id)
        await run_in_threadpool(state.responses.delete, response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, order: str = "desc", limit: int = 20,
                                    after: str | None = None) -> Response:
        if order not in ("asc", "desc"):
            raise bad_request("'order' must be asc or desc", param="order", code="invalid_value")
        if not 1 <= limit <= 100:
            raise bad_request("'limit' must be an integer in [1, 100]", param="limit", code="invalid_value")
        return JSONResponse(input_items_page(await stored(response_id), order, limit, after))

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        from ..audio import AudioError, load_audio_bytes

        try:
            if not state.speech:
                raise APIError(404, f"model '{config.model_name}' is not a speech model; serve a Whisper bundle to "
                                    "transcribe", code="model_not_found")
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
                raise APIError(413, f"the upload is {declared} bytes; this server takes at most {config.max_body_bytes}",
                               code="request_too_large")
            try:
                form = await request.form(max_part_size=config.max_body_bytes)
            except Exception as e:
                raise bad_request(f"the body must be multipart/form-data with a 'file' field ({e})", param="file") from None
            check_model({"model": form.get("model")}, config.model_name)
            upload = form.get("file")
            if upload is None or isinstance(upload, str):
                raise bad_request("'file' is required: the audio file (WAV) to transcribe", param="file",
                                  code="missing_required_parameter")
            fmt = form.get("response_format") or "json"
            if fmt not in ("json", "text"):
                raise bad_request(f"response_format {fmt!r} is not supported; use json or text", param="response_format",
                                  code="unsupported_parameter")
            if form.get("language") not in (None, "", "en"):
                raise bad_request("only English ('en') is transcribed", param="language", code="unsupported_parameter")
            if form.get("temperature") not in (None, "", "0", "0.0"):
                raise bad_request("only temperature 0 (greedy) is supported", param="temperature",
                                  code="unsupported_parameter")
            data, name = await upload.read(), upload.filename or "the upload"

            def transcribe() -> str:  # parsing, resampling and decoding all off the event loop
                return state.transcriber.transcribe(load_audio_bytes(data, name)).text

            try:
                text = await run_in_threadpool(transcribe)
            except AudioError as e:
                raise bad_request(str(e), param="file", code="invalid_audio") from None
        except QueueFullError as e:
            state.count("transcription", 429)
            raise APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(config.retry_after_s)}) from None
        except APIError as e:
            state.count("transcription", e.status)
            raise
        state.count("transcription", 200)
        return PlainTextResponse(text) if fmt == "text" else JSONResponse({"text": text})

    return app
