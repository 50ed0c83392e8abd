"""The OpenAI request bodies this server takes, checked into one `GenerationRequest` (or an APIError).

Parameters the server cannot honour (n > 1, legacy functions, logprobs, penalties other than repetition,
logit_bias, echo, suffix, best_of) are refused with a 400 that names them, never silently ignored.
Structured outputs (`response_format` json_schema / json_object, and vLLM's ``guided_json``,
``guided_regex`` and ``guided_grammar`` (Lark) as extensions) constrain the sampled tokens (`grammar`);
``tools`` and ``tool_choice`` are `tools`'.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from ..grammar import Grammar, GrammarError
from ..params import SamplingParams
from . import tools as tool_calls
from .errors import APIError, bad_request, unsupported

MAX_STOP_STRINGS = 4  # as the OpenAI API


@dataclass
class GenerationRequest:
    """A checked chat or completion request."""

    kind: str  # "chat" | "completion"
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)
    tools: tool_calls.ToolSet | None = None  # the request's tools (its reply parsed for calls when active)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"We could not parse the JSON body of your request ({e}). The body must be a JSON object, "
                          "e.g. {\"model\": ..., \"messages\": [...]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object, not " + type(body).__name__, code="invalid_json")
    return body


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad_request(f"'{name}' must be a number in [{lo}, {hi}], got {v!r}", param=name, code="invalid_value")
    return float(v)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise bad_request(f"'{name}' must be {bound}, got {v!r}", param=name, code="invalid_value")
    return v


def _refuse_unsupported(body: dict, kind: str) -> None:
    if body.get("n") not in (None, 1):
        raise unsupported("n", "generating several choices per request (n > 1)")
    for name in ("functions", "function_call"):
        if body.get(name) not in (None, [], {}):
            raise unsupported(name, "the legacy functions API (use tools and tool_choice)")
    if kind == "completion":
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(name) not in (None, [], {}):
                raise unsupported(name, "tool calling in /v1/completions (use /v1/chat/completions)")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise unsupported("logprobs" if body.get("logprobs") not in (None, False, 0) else "top_logprobs", "log probabilities")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise unsupported(name, f"{name} (use repetition_penalty)")
    if body.get("logit_bias") not in (None, {}):
        raise unsupported("logit_bias", "logit_bias")
    if kind == "completion":
        if body.get("echo"):
            raise unsupported("echo", "echo")
        if body.get("suffix") not in (None, ""):
            raise unsupported("suffix", "suffix")
        if body.get("best_of") not in (None, 1):
            raise unsupported("best_of", "best_of > 1")


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required: the name of the served model (see GET /v1/models)", param="model",
                          code="missing_required_parameter")
    if model != served:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{served}'", param="model",
                       code="model_not_found")


def _messages(body: dict) -> list[dict[str, Any]]:
    """{role, content} each (content text), an assistant's ``tool_calls`` and a tool result's ``tool_call_id``
    kept (`tools.render` renders them)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects", param="messages",
                          code="invalid_value")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise bad_request(f"messages[{i}] needs a role of system, developer, user, assistant or tool",
                              param=f"messages[{i}]", code="invalid_value")
        content = m.get("content")
        calls = None
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = tool_calls.check_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            content = "" if content is None else content
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise unsupported(f"messages[{i}].content", "content parts other than text")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", param=f"messages[{i}]",
                              code="invalid_value")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls:
            msg["tool_calls"] = calls
        if role == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id") or "")
        out.append(msg)
    return out


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them",
                          param="stop", code="invalid_value")
    return stops


def generation_params(body: dict, prompt_ids: list[int], engine: Any, where: str, names: tuple[str, ...]) -> SamplingParams:
    """The sampling parameters of a request body whose prompt is ``prompt_ids`` (in the body's field ``where``): the
    first of ``names`` given caps the new tokens (default: the rest of the context), which must fit the model's
    context; temperature, top_p, and the extensions top_k, seed and repetition_penalty."""
    limit = engine.max_seq_len
    given = [n for n in names if body.get(n) is not None]
    max_tokens = _int(body, given[0], 1) if given else None
    if max_tokens is None:
        max_tokens = limit - len(prompt_ids)
    if len(prompt_ids) + max(max_tokens, 1) > limit:
        raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the {where}, {max_tokens} in the "
                          f"completion). Please reduce the length of the {where} or completion.",
                          param=given[0] if given else where, code="context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0  # nothing but the most likely token
    try:
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=_int(body, "top_k", 0) or 0,
                              seed=_int(body, "seed", 0, 2**63 - 1), max_new_tokens=max_tokens,
                              repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.01, 100.0))
    except InputError as e:
        raise bad_request(str(e), code="invalid_value") from None


def format_grammar(fmt: Any, param: str, nested: bool) -> Grammar | None:
    """The grammar of an OpenAI output format: ``{"type": "text"}`` (none), ``{"type": "json_object"}``, or
    ``{"type": "json_schema", ...}`` with the schema under ``json_schema.schema`` (Chat Completions: ``nested``)
    or ``schema`` (Responses' ``text.format``)."""
    if fmt in (None, {}):
        return None
    if not isinstance(fmt, dict):
        raise bad_request(f"'{param}' must be an object, e.g. {{\"type\": \"json_object\"}}", param=param,
                          code="invalid_value")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind != "json_schema":
        raise bad_request(f"'{param}.type' must be text, json_object or json_schema, got {kind!r}", param=param,
                          code="invalid_value")
    spec = fmt.get("json_schema") if nested else fmt
    where = f"{param}.json_schema" if nested else param
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request(f"'{where}.schema' is required: the JSON schema the output must match", param=param,
                          code="invalid_value")
    return Grammar.json_schema(spec["schema"])


def constraint_param(body: dict, fmt_param: str) -> str:
    """The field a request's output constraint came in (for errors about it)."""
    return next((n for n in ("guided_json", "guided_regex", "guided_grammar") if body.get(n) is not None), fmt_param)


def request_grammar(body: dict, fmt: Any, fmt_param: str, nested: bool, engine: Any) -> Grammar | None:
    """The one grammar a request asks for (its output format, or an extension: ``guided_json``, ``guided_regex``,
    ``guided_grammar`` in Lark), compiled against the engine's tokenizer: 400 with the engine's reason if it
    cannot be, or if several are given."""
    given: list[tuple[str, Grammar]] = []
    g = format_grammar(fmt, fmt_param, nested)
    if g is not None:
        given.append((fmt_param, g))
    guided_json = body.get("guided_json")
    if guided_json is not None:
        if isinstance(guided_json, str):
            try:
                guided_json = json.loads(guided_json)
            except json.JSONDecodeError as e:
                raise bad_request(f"'guided_json' is not valid JSON: {e}", param="guided_json", code="invalid_value") from None
        if not isinstance(guided_json, dict):
            raise bad_request("'guided_json' must be a JSON schema object", param="guided_json", code="invalid_value")
        given.append(("guided_json", Grammar.json_schema(guided_json)))
    for name, make in (("guided_regex", Grammar.regex), ("guided_grammar", Grammar.lark)):
        v = body.get(name)
        if v is not None:
            if not isinstance(v, str) or not v:
                raise bad_request(f"'{name}' must be a non-empty string", param=name, code="invalid_value")
            given.append((name, make(v)))
    if len(given) > 1:
        raise bad_request(f"only one output constraint a request; got {', '.join(n for n, _ in given)}",
                          param=given[1][0], code="invalid_value")
    if not given:
        return None
    name, grammar = given[0]
    try:
        engine.grammars.compile(grammar)
    except GrammarError as e:
        raise bad_request(str(e), param=name, code="invalid_value") from None
    return grammar


def parse_generation(body: dict, kind: str, engine: Any, served: str) -> GenerationRequest:
    """Check a /v1/chat/completions (kind "chat") or /v1/completions body against the engine."""
    check_model(body, served)
    _refuse_unsupported(body, kind)
    tools = None
    if kind == "chat":
        messages = _messages(body)
        tools = tool_calls.parse_tools(body, engine, nested=True)
        if not engine.manifest.generation.get("chat_template"):
            raise bad_request(f"model '{served}' has no chat template; use /v1/completions", param="messages")
        tok = engine.tokenizer
        prompt_ids = tok.encode(tool_calls.render(tok, messages, tools))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            prompt_ids = engine.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            try:
                prompt_ids = engine.check_token_ids(prompt)
            except InputError as e:
                raise bad_request(str(e), param="prompt", code="invalid_value") from None
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise unsupported("prompt", "a batch of several prompts in one request")
        else:
            raise bad_request("'prompt' must be a string or a list of token ids", param="prompt", code="invalid_value")
    if not prompt_ids:
        raise bad_request("the prompt is empty", param="messages" if kind == "chat" else "prompt", code="invalid_value")
    params = generation_params(body, prompt_ids, engine, "messages" if kind == "chat" else "prompt",
                               ("max_completion_tokens", "max_tokens"))
    grammar = request_grammar(body, body.get("response_format"), "response_format", True, engine)
    grammar = tool_calls.request_grammar(tools, grammar, constraint_param(body, "response_format"), engine)
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", param="stream", code="invalid_value")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise bad_request("'stream_options' is only allowed with stream: true, as an object", param="stream_options",
                          code="invalid_value")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be true or false", param="ignore_eos", code="invalid_value")
    return GenerationRequest(kind, prompt_ids, params, _stop(body), stream,
                             bool(options and options.get("include_usage")), ignore_eos, tools)
