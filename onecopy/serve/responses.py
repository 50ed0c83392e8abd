"""The OpenAI Responses API over the scheduler: a response id names the conversation after its turn.

``POST /v1/responses`` takes ``input`` (text or message items), ``instructions``, ``previous_response_id``,
``store``, ``stream`` (the Responses event stream), ``max_output_tokens`` and the sampling parameters; a stored
response is read back with ``GET /v1/responses/{id}`` (and its input items with ``.../input_items``) and removed with
``DELETE``. A turn on ``previous_response_id`` continues that conversation: its prompt is the previous turn's exact
token ids (prompt and reply as generated, never re-tokenized) followed by the rendered new messages, so the state
the previous turn left (a kept conversation, or its blocks in the prefix cache: the mechanism chat completions use)
covers all but the new input, which is all that is prefilled. As in OpenAI's API, ``instructions`` apply to their
own turn only.

Tools (`tools`): ``tools`` in the Responses form, ``tool_choice`` and ``parallel_tool_calls``; calls come back as
``function_call`` output items (streamed as the API does: the item added, its arguments' deltas, done), and their
results go in as ``function_call_output`` input items, on ``previous_response_id`` or with the calls in ``input``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from functools import cached_property
from pathlib import Path
from typing import Any, AsyncIterator

from ..errors import InputError
from ..state_files import oldest_first
from .errors import APIError, bad_request, unsupported
from . import tools as tool_calls
from .protocol import GenerationRequest, constraint_param, check_model, generation_params, request_grammar
from .tools import Arguments, CallEnd, CallFailed, CallStart, Text

log = logging.getLogger(__name__)

DEFAULT_MAX_STORED = 10_000  # responses kept in memory for previous_response_id / GET (least recently used go first)
DEFAULT_MAX_STORED_BYTES = 1 << 30  # ... and at most about this many bytes of them (`StoredResponse.nbytes`)
DEFAULT_MAX_FILE_BYTES = 4 << 30  # bytes of response files a state directory keeps (least recently written go first)
RESPONSE_ID_HEADER = "x-onecopy-response-id"  # names a turn's id: the replicas' ingress routes turns on it there


@dataclass
class StoredResponse:
    """A finished turn as the store keeps it: the response object and what the next turn builds on."""

    id: str
    body: dict[str, Any]  # the response object, as GET returns it
    input_items: list[dict[str, Any]]  # this turn's input, with item ids
    messages: list[dict[str, Any]]  # the conversation through this turn's reply (no instructions; `tools.render`'s)
    instructions: str | None
    prompt_text: str  # this turn's rendered prompt
    token_ids: array | None  # its prompt ids and the reply's ids (no stop id): what the next turn starts with
    reply_text: str

    def __post_init__(self) -> None:
        if self.token_ids is not None and not isinstance(self.token_ids, array):
            self.token_ids = array("i", self.token_ids)  # 4 bytes an id (a list of ints takes ~9x that)

    @cached_property
    def nbytes(self) -> int:
        """About what the entry holds in memory: its ids and its texts (the conversation's, the prompt's)."""
        ids = 4 * len(self.token_ids) if self.token_ids is not None else 0
        return ids + len(self.prompt_text) + len(self.reply_text) + len(json.dumps(self.messages)) \
            + len(json.dumps(self.body)) + len(json.dumps(self.input_items))


RECORD_FORMAT = "onecopy-response/1"
_ID = re.compile(r"resp_[0-9a-f]{32}")  # what `ResponseTurn` names a response; nothing else reaches the disk


class ResponseStore:
    """Stored responses by id: in memory, at most ``max_entries`` of at most ``max_bytes`` in all (least recently
    used evicted), and with a
    ``directory`` also one JSON file each there (written atomically, removed on delete), so that a server
    started again on the same directory, or another replica sharing it, answers ``previous_response_id`` from
    them (its first turn loads the KV blocks a disk tier kept, or re-prefills the history). The files stay under
    ``max_file_bytes`` (the least recently written deleted first, their responses gone: 404). A file from another
    model (``fingerprint``: the bundle's), or one that does not parse, is no response here: not found, and logged.
    Thread-safe."""

    def __init__(self, max_entries: int = DEFAULT_MAX_STORED, directory: Path | None = None,
                 fingerprint: str = "", max_bytes: int = DEFAULT_MAX_STORED_BYTES,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries, self.max_bytes, self.directory, self.fingerprint = max_entries, max_bytes, directory, fingerprint
        self.max_file_bytes = max_file_bytes
        self._files: OrderedDict[str, int] = OrderedDict()  # this directory's response files: id -> bytes, oldest first
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)  # conversations: the server's user's alone
            self._files.update(oldest_first(directory, _ID, ".json"))
        self._file_bytes = sum(self._files.values())
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._memory_only: set[str] = set()  # entries whose file could not be written
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        if not _ID.fullmatch(response_id):
            return None
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
        if entry is not None:
            if self.directory is not None and response_id not in self._memory_only \
                    and not self._path(response_id).is_file():
                self._forget(response_id)  # deleted through another server sharing the directory
                return None
            return entry
        entry = self._read(response_id)
        if entry is not None:
            self._remember(entry)
        return entry

    def put(self, entry: StoredResponse) -> None:
        """Keep ``entry`` (blocking: file I/O with a directory). A file that cannot be written is logged and
        the entry kept in memory only: the turn it answers was generated, and its client gets it."""
        written = True
        if self.directory is not None:
            record = {"format": RECORD_FORMAT, "fingerprint": self.fingerprint, **asdict(entry),
                      "token_ids": None if entry.token_ids is None else entry.token_ids.tolist()}
            tmp = self.directory / f".{entry.id}.{uuid.uuid4().hex[:8]}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump(record, f)
                    size = f.tell()
                os.replace(tmp, self._path(entry.id))
                self._filed(entry.id, size)
            except OSError as e:
                log.error("response %s not written to %s (%s): kept in memory only", entry.id, self.directory, e)
                tmp.unlink(missing_ok=True)
                written = False
        self._remember(entry)
        if not written:
            with self._lock:
                self._memory_only.add(entry.id)

    def delete(self, response_id: str) -> bool:
        """Forget a response, in memory and on disk; whether there was one."""
        if not _ID.fullmatch(response_id):
            return False
        found = self._forget(response_id)
        if self.directory is not None:
            path = self._path(response_id)
            found = found or path.is_file()
            path.unlink(missing_ok=True)
            with self._lock:
                self._file_bytes -= self._files.pop(response_id, 0)
        return found

    def _path(self, response_id: str) -> Path:
        return self.directory / f"{response_id}.json"

    def _filed(self, response_id: str, size: int) -> None:
        """A file written: counted, and the least recently written past ``max_file_bytes`` deleted, with
        their responses (this one is kept whatever its size)."""
        with self._lock:
            self._file_bytes += size - self._files.pop(response_id, 0)
            self._files[response_id] = size
            gone = []
            while self._file_bytes > self.max_file_bytes and len(self._files) > 1:
                old, n = self._files.popitem(last=False)
                self._file_bytes -= n
                gone.append(old)
        for old in gone:
            self._forget(old)
            self._path(old).unlink(missing_ok=True)

    def _forget(self, response_id: str) -> bool:
        with self._lock:
            self._memory_only.discard(response_id)
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._bytes -= entry.nbytes
            return entry is not None

    def _remember(self, entry: StoredResponse) -> None:
        self._forget(entry.id)
        with self._lock:
            self._entries[entry.id] = entry
            self._bytes += entry.nbytes
            while len(self._entries) > 1 and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                _, old = self._entries.popitem(last=False)  # its file, if any, stays: read back when asked for
                self._bytes -= old.nbytes
                self._memory_only.discard(old.id)  # none: gone

    def _read(self, response_id: str) -> StoredResponse | None:
        if self.directory is None:
            return None
        path = self._path(response_id)
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("stored response %s is unreadable (%s): treated as not found", path, e)
            return None
        if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
            log.warning("%s is not a stored response (format %r): treated as not found", path,
                        record.get("format") if isinstance(record, dict) else None)
            return None
        if record.get("fingerprint") != self.fingerprint:
            log.warning("stored response %s belongs to another model (bundle fingerprint %s): treated as not found",
                        path, str(record.get("fingerprint"))[:12])
            return None
        try:
            fields = {f.name: record[f.name] for f in dataclass_fields(StoredResponse)}
            entry = StoredResponse(**fields)
        except (KeyError, TypeError) as e:
            log.warning("stored response %s lacks %s: treated as not found", path, e)
            return None
        return entry if entry.id == response_id else None


def not_found(response_id: str, param: str | None = None) -> APIError:
    """404 for a read of an unknown response; 400 for a turn on one (`previous_response_id`), as OpenAI's API."""
    what = "Previous response" if param == "previous_response_id" else "Response"
    return APIError(400 if param else 404, f"{what} with id '{response_id}' not found (never stored, deleted, or "
                    "evicted from this server's store).", param=param,
                    code="previous_response_not_found" if param else "not_found")


@dataclass
class ResponseTurn:
    """A checked /v1/responses request: the generation to run and what its stored response will hold."""

    req: GenerationRequest
    instructions: str | None
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]  # the conversation before this turn's reply (no instructions)
    prompt_text: str
    previous: StoredResponse | None
    store: bool
    metadata: dict[str, str]
    max_output_tokens: int | None  # as given (None: the rest of the context)
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})  # as given: the response echoes it
    tools: list[dict[str, Any]] = field(default_factory=list)  # as given, with tool_choice and parallel_tool_calls
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)  # what _ID matches
    created_at: float = field(default_factory=time.time)


_ROLES = ("user", "assistant", "system", "developer")
_UNSUPPORTED = {"reasoning": "reasoning options",
                "include": "include", "background": "background responses", "prompt": "prompt templates",
                "conversation": "conversation objects (use previous_response_id)"}


def _call_item(m: dict, where: str) -> dict[str, Any]:
    """A ``function_call`` (a call the model made, given back) or ``function_call_output`` (its result) input item."""
    kind = m["type"]
    need = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
    missing = [k for k in need if not isinstance(m.get(k), str)]
    if missing:
        raise bad_request(f"{where} ({kind}) needs {', '.join(need)} as strings; missing or not a string: "
                          f"{', '.join(missing)}", param=where, code="invalid_value")
    prefix = "fc_" if kind == "function_call" else "fco_"
    return {"id": m.get("id") or prefix + uuid.uuid4().hex, "type": kind, **{k: m[k] for k in need},
            "status": "completed"}


def _input_items(body: dict) -> list[dict[str, Any]]:
    """``input`` as message items {id, type, role, content: [{type: input_text | output_text, text}]}, and
    function_call / function_call_output items."""
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("'input' must be a non-empty string or a list of message items {role, content}", param="input",
                          code="invalid_value")
    items = []
    for i, m in enumerate(raw):
        where = f"input[{i}]"
        if isinstance(m, dict) and m.get("type") in ("function_call", "function_call_output"):
            items.append(_call_item(m, where))
            continue
        if not isinstance(m, dict) or m.get("type", "message") != "message":
            kind = m.get("type") if isinstance(m, dict) else type(m).__name__
            raise unsupported(where, f"input items of type {kind!r} (messages, function_call and "
                                     "function_call_output only)")
        if m.get("role") not in _ROLES:
            raise bad_request(f"{where} needs a role of {', '.join(_ROLES)}", param=where, code="invalid_value")
        content = m.get("content")
        if isinstance(content, str):
            parts = [content]
        elif isinstance(content, list) and content and all(
                isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                and isinstance(p.get("text"), str) for p in content):
            parts = [p["text"] for p in content]
        elif isinstance(content, list) and content:
            raise unsupported(f"{where}.content", "content parts other than text")
        else:
            raise bad_request(f"{where}.content must be a string or a list of text parts", param=where,
                              code="invalid_value")
        kind = "output_text" if m["role"] == "assistant" else "input_text"
        items.append({"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": m["role"], "status": "completed",
                      "content": [{"type": kind, "text": t} for t in parts]})
    return items


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be true or false", param=name, code="invalid_value")
    return v


def _chat_messages(system: str | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return ([{"role": "system", "content": system}] if system else []) + messages


def _item_messages(items: list[dict[str, Any]], before: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages after the conversation ``before``: function_call items join the assistant
    message before them (or make one), function_call_output items become tool messages, each answering a call
    the conversation made (400 otherwise)."""
    out: list[dict[str, Any]] = []
    called = {c["id"] for m in before for c in m.get("tool_calls", ())}
    for i, item in enumerate(items):
        if item["type"] == "function_call":
            call = tool_calls.chat_call(item["call_id"], item["name"], item["arguments"] or "{}")  # as check_tool_calls
            called.add(item["call_id"])
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", ()), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item["type"] == "function_call_output":
            if item["call_id"] not in called:
                raise bad_request(f"input[{i}]: no function call with call_id '{item['call_id']}' precedes this "
                                  "function_call_output (give its function_call item in 'input', or continue the "
                                  "response that made it with 'previous_response_id')", param=f"input[{i}]",
                                  code="invalid_value")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            out.append({"role": "system" if item["role"] == "developer" else item["role"],
                        "content": "".join(p["text"] for p in item["content"])})
    return out


def parse_response_request(body: dict, engine: Any, served: str, store: ResponseStore) -> ResponseTurn:
    """Check a /v1/responses body against the engine and the store (an unknown previous_response_id: 400)."""
    check_model(body, served)
    for name, what in _UNSUPPORTED.items():
        if body.get(name) not in (None, [], {}, False):
            raise unsupported(name, what)
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise bad_request("'text' must be an object, e.g. {\"format\": {\"type\": \"text\"}}", param="text",
                          code="invalid_value")
    if body.get("truncation") not in (None, "disabled"):
        raise unsupported("truncation", "truncation other than 'disabled'")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", param="instructions", code="invalid_value")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise bad_request("'metadata' must be an object of string values", param="metadata", code="invalid_value")
    items = _input_items(body)
    previous = None
    prev_id = body.get("previous_response_id")
    if prev_id is not None:
        if not isinstance(prev_id, str) or not prev_id:
            raise bad_request("'previous_response_id' must be a response id", param="previous_response_id",
                              code="invalid_value")
        previous = store.get(prev_id)
        if previous is None:
            raise not_found(prev_id, "previous_response_id")
    if not engine.manifest.generation.get("chat_template"):
        raise bad_request(f"model '{served}' has no chat template; use /v1/completions", param="input")
    tools = tool_calls.parse_tools(body, engine, nested=False)
    before = previous.messages if previous is not None else []
    messages = before + _item_messages(items, before)
    tok = engine.tokenizer
    try:
        prompt_text = tool_calls.render(tok, _chat_messages(instructions, messages), tools)
    except InputError as e:  # e.g. a template that takes no system message after the first turn
        raise bad_request(str(e), param="input", code="invalid_value") from None
    prompt_ids = None
    if previous is not None and previous.token_ids is not None and instructions == previous.instructions:
        # The previous turn's ids as generated, then the new text: its state covers all but the new input.
        before = previous.prompt_text + previous.reply_text
        if prompt_text.startswith(before):
            prompt_ids = previous.token_ids.tolist() + tok.encode(prompt_text[len(before):])
    if prompt_ids is None:
        prompt_ids = tok.encode(prompt_text)
    params = generation_params(body, prompt_ids, engine, "input", ("max_output_tokens",))
    grammar = request_grammar(body, (text or {}).get("format"), "text.format", False, engine)
    grammar = tool_calls.request_grammar(tools, grammar, constraint_param(body, "text.format"), engine)
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar)
    req = GenerationRequest("chat", prompt_ids, params, [], _flag(body, "stream", False), tools=tools)
    fmt = (text or {}).get("format") or {"type": "text"}
    return ResponseTurn(req, instructions, items, messages, prompt_text, previous, _flag(body, "store", True), metadata,
                        body.get("max_output_tokens"), fmt, body.get("tools") or [], body.get("tool_choice") or "auto",
                        tools.parallel if tools is not None else _flag(body, "parallel_tool_calls", True))


class ResponsesRun:
    """One /v1/responses request in flight over a `app._Generation` (its stream, text, settlement, metrics):
    the response object or its event stream, and the stored response once it finished."""

    def __init__(self, run: Any, turn: ResponseTurn, store: ResponseStore) -> None:
        self.run, self.turn, self.store = run, turn, store
        self.seq = 0

    def response(self, status: str, output: list[dict[str, Any]], error: APIError | None = None) -> dict[str, Any]:
        t, req, run = self.turn, self.turn.req, self.run
        usage = None
        if status in ("completed", "incomplete"):
            u = run.usage()
            usage = {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                     "total_tokens": u["total_tokens"],
                     "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        return {"id": t.id, "object": "response", "created_at": t.created_at, "status": status,
                "model": run.state.config.model_name, "output": output, "instructions": t.instructions,
                "previous_response_id": t.previous.id if t.previous is not None else None,
                "max_output_tokens": t.max_output_tokens, "temperature": req.params.temperature,
                "top_p": req.params.top_p, "store": t.store, "metadata": t.metadata, "usage": usage,
                "error": None if error is None else {"code": error.code or "server_error", "message": error.message},
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "text": {"format": t.text_format}, "tool_choice": t.tool_choice, "tools": t.tools,
                "parallel_tool_calls": t.parallel_tool_calls, "truncation": "disabled", "reasoning": None,
                "user": None}

    @staticmethod
    def message(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
        return {"id": item_id or "msg_" + uuid.uuid4().hex, "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def function_call(call: tool_calls.Call, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
        return {"id": item_id or "fc_" + uuid.uuid4().hex, "type": "function_call", "status": status,
                "arguments": call.arguments, "call_id": call.id, "name": call.name}

    def status(self) -> str:
        """The finished reply's response status."""
        return "completed" if self.run.finish_reason(False) == "stop" else "incomplete"

    def output(self, text: str) -> list[dict[str, Any]]:
        """A whole reply's output items, as a stream of it makes them (`_StreamedItems`): its text as messages and
        its calls as function_call items, in order."""
        items = _StreamedItems(self)
        items.push(self.run.reply_events(text, last=True))
        items.close(self.status())
        return items.output

    def finished(self, text: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The final response object of the reply ``text`` with its ``output`` items; stored (with what the next
        turn builds on) unless ``store`` is false."""
        run, t = self.run, self.turn
        body = self.response(self.status(), output)
        if t.store:
            ids = run.stream.ids
            if ids and run.stream.finish_reason == "stop":
                ids = ids[:-1]  # the stop id: sampled, not part of the reply the template renders
            content = "".join(p["text"] for i in output if i["type"] == "message" for p in i["content"])
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            calls = [tool_calls.chat_call(i["call_id"], i["name"], i["arguments"])
                     for i in output if i["type"] == "function_call" and i["status"] == "completed"]
            if calls:
                reply["tool_calls"] = calls
            self.store.put(StoredResponse(t.id, body, t.input_items, t.messages + [reply], t.instructions,
                                          t.prompt_text, t.req.prompt_ids + list(ids), text))
        return body

    async def collect(self) -> dict[str, Any]:
        from starlette.concurrency import run_in_threadpool

        text = await self.run.text("responses")
        return await run_in_threadpool(self.finished, text, self.output(text))  # the store may write a file

    def event(self, type: str, **fields: Any) -> str:
        obj = {"type": type, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type}\ndata: {json.dumps(obj)}\n\n"

    async def events(self) -> AsyncIterator[str]:
        """The Responses event stream: created, in_progress, then each output item: a message (added, its text part
        added, text deltas, each done) or a function call (added, its arguments' deltas, done), then completed or
        incomplete (failed, with its error, if the request failed)."""
        import asyncio

        run, loop = self.run, asyncio.get_running_loop()
        finished, status = False, 200
        try:
            yield self.event("response.created", response=self.response("in_progress", []))
            yield self.event("response.in_progress", response=self.response("in_progress", []))
            items = _StreamedItems(self)
            pieces, failed = [], None
            try:
                async for token_id in run.stream:
                    piece = run.reply.push(token_id)
                    pieces.append(piece)
                    for e in items.push(run.reply_events(piece)):
                        yield e
            except Exception as e:
                failed = run.failure(e)
            failed = failed or run.failure()
            if failed is not None:
                yield self.event("response.failed", response=self.response("failed", [], failed))
                finished, status = True, failed.status
                return
            tail = run.reply.flush()
            pieces.append(tail)
            for e in items.push(run.reply_events(tail, last=True)) + items.close(self.status()):
                yield e
            body = await loop.run_in_executor(None, self.finished, "".join(pieces), items.output)  # may write a file
            yield self.event(f"response.{body['status']}", response=body)
            finished = True
        finally:
            if not finished:
                run.stream.cancel(wait=False)  # never block the event loop; the loop frees the row
            loop.run_in_executor(None, run._settle_and_count, status if finished else 499, "responses")


class _StreamedItems:
    """A streamed reply's output items, as the events that open, fill and close them."""

    def __init__(self, run: ResponsesRun) -> None:
        self.run = run
        self.output: list[dict[str, Any]] = []  # the items closed so far
        self.message: tuple[str, list[str]] | None = None  # the open message item: its id and text
        self.call: tuple[str, tool_calls.Call] | None = None  # the open function_call item: its id and call

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.message[0], "output_index": len(self.output), "content_index": 0}

    def push(self, events: list[tool_calls.Event]) -> list[str]:
        ev, out = self.run.event, []
        for e in events:
            if isinstance(e, Text):
                if self.message is None:
                    out += self._open_message()
                self.message[1].append(e.text)
                out.append(ev("response.output_text.delta", **self._where(), delta=e.text, logprobs=[]))
            elif isinstance(e, CallStart):
                out += self._close_message()
                call = tool_calls.Call(e.id, e.name)
                self.call = ("fc_" + uuid.uuid4().hex, call)
                item = self.run.function_call(call, "in_progress", self.call[0])
                out.append(ev("response.output_item.added", output_index=len(self.output), item=item))
            elif isinstance(e, Arguments):
                self.call[1].arguments += e.text
                out.append(ev("response.function_call_arguments.delta", item_id=self.call[0],
                              output_index=len(self.output), delta=e.text))
            elif isinstance(e, CallEnd):
                out += self._close_call("completed")
            elif isinstance(e, CallFailed):  # a call opened that is no call (cut by max_output_tokens): incomplete
                out += self._close_call("incomplete")
        return out

    def close(self, status: str) -> list[str]:
        """The reply ended, the response ``status``: the open item closed with it (a call cut short is
        incomplete); an empty reply is one empty message."""
        out = self._close_call("incomplete") if self.call is not None else []
        if not self.output and self.message is None:
            out += self._open_message()
        return out + self._close_message(status)

    def _open_message(self) -> list[str]:
        self.message = ("msg_" + uuid.uuid4().hex, [])
        ev = self.run.event
        item = {"id": self.message[0], "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        return [ev("response.output_item.added", output_index=len(self.output), item=item),
                ev("response.content_part.added", **self._where(), part={"type": "output_text", "text": "",
                                                                          "annotations": []})]

    def _close_message(self, status: str = "completed") -> list[str]:
        if self.message is None:
            return []
        ev, where, text = self.run.event, self._where(), "".join(self.message[1])
        item = self.run.message(text, status, self.message[0])
        out = [ev("response.output_text.done", **where, text=text, logprobs=[]),
               ev("response.content_part.done", **where, part=item["content"][0]),
               ev("response.output_item.done", output_index=len(self.output), item=item)]
        self.output.append(item)
        self.message = None
        return out

    def _close_call(self, status: str) -> list[str]:
        (item_id, call), ev, index = self.call, self.run.event, len(self.output)
        item = self.run.function_call(call, status, item_id)
        out = [ev("response.function_call_arguments.done", item_id=item_id, output_index=index, name=call.name,
                  arguments=call.arguments),
               ev("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        self.call = None
        return out


def input_items_page(entry: StoredResponse, order: str, limit: int, after: str | None) -> dict[str, Any]:
    """GET /v1/responses/{id}/input_items: the turn's input items, ``order`` asc or desc, ``limit`` after ``after``."""
    items = list(entry.input_items) if order == "asc" else list(reversed(entry.input_items))
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise bad_request(f"'after' names no input item of response '{entry.id}'", param="after", code="invalid_value")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
