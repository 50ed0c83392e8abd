"""Tools (function calling): a request's tools and tool_choice checked, rendered into the prompt, the grammar of a
forced call, and the calls parsed out of the reply as it streams.

Calls are written the Hermes / Qwen way: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; a reply's
calls are also read in the XML form of Qwen3.5's and Qwen3-Coder's templates (``<tool_call>\\n<function=NAME>\\n
<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>``, each value typed by the tool's schema), and a
free reply that is only JSON calls in Llama 3.1's form (``<|python_tag|>{"name": ..., "parameters": {...}}``). A forced
call is generated in the XML form where the chat template teaches it (`teaches_xml_calls`), else in the JSON one. A chat
template that reads a ``tools`` variable renders the tools and the history's calls itself; for one that does not
(SmolLM2's) onecopy puts the tools in the system prompt, with the instruction to answer a call in that form, and
renders the history's calls as those blocks and tool results as ``<tool_response>`` blocks in a user turn.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..grammar import Grammar, GrammarError
from .errors import bad_request, unsupported

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's marker before a call (its templates' bare JSON calls)
CHOICES = ("auto", "none", "required")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
# The start of a call up to its arguments object: its name is known before the arguments stream
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_HEAD_MAX = 300  # characters after OPEN (and its whitespace) without a recognised head: the block is read whole at CLOSE


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, description and JSON schema of its arguments."""

    name: str
    description: str | None
    parameters: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        """The Chat Completions form (what templates and the tools block show the model)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolSet:
    """A request's tools and its choice: "auto" (the model decides; the reply is parsed), "none" (no tools shown,
    nothing parsed), "required" (one call of any tool, constrained) or "function" (one call of ``name``)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True  # as given (the response echoes it); a constrained reply is one call either way

    @property
    def active(self) -> bool:
        """Whether the tools are shown to the model and its reply parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The tools a constrained call chooses among (none: unconstrained)."""
        if self.choice == "required":
            return self.tools
        return tuple(t for t in self.tools if t.name == self.name) if self.choice == "function" else ()

    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    def parameters(self) -> dict[str, dict[str, Any]]:
        """Each tool's JSON schema of its arguments, by name (what types an XML-form call's values)."""
        return {t.name: t.parameters for t in self.tools}


def _json_arg(schema: dict[str, Any]) -> str:
    """A JSON-schema rule's text for llguidance's Lark ``%json``, compact as `Grammar.json_schema`'s."""
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False, **schema.get("x-guidance", {})}})


def call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON of one call of ``tool``: {"name": its name, "arguments": its parameters}. Definitions move to the
    root, where the parameters' ``#/$defs/...`` references point once the parameters are nested."""
    params = {"type": "object", **tool.parameters}  # an object whatever the schema leaves open ({}: any object)
    defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False, **defs}


def teaches_xml_calls(tokenizer: Any) -> bool:
    """Whether a bundle's chat template teaches calls in the XML form (Qwen3.5's, Qwen3-Coder's ``<function=...>``
    blocks): a forced call is then generated in that form, the one the model was trained to write."""
    return "<function=" in (getattr(tokenizer, "chat_template", None) or "")


def _lark_text(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text, ensure_ascii=False)


_XML_END = "\n</parameter>\n"  # after each XML-form value


def _xml_value_rule(schema: Any, rule: str, defs: dict[str, Any]) -> tuple[str, list[str]] | None:
    """The grammar of one XML-form value of ``schema`` up to its parameter's end: (expansion, extra rules), or None
    where raw text cannot carry it as `xml_value` reads it back (a string with a pattern or a format, a string-or-
    other type)."""
    if not isinstance(schema, dict):
        return None
    choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if isinstance(choices, list) and choices:  # written as xml_value reads them: strings raw, others as JSON
        words = [v if isinstance(v, str) else json.dumps(v) for v in choices]
        return "(" + " | ".join(_lark_text(w) for w in words) + ") " + _lark_text(_XML_END), []
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds] if kinds is not None else []
    if not schema or kinds == ["string"]:
        if set(schema) - {"type", "minLength", "maxLength", "description", "title"}:
            return None  # pattern, format ...: not checkable on raw text here
        lo, hi = schema.get("minLength", 0), schema.get("maxLength", "")
        return rule, [f"{rule}[suffix={_lark_text(_XML_END)}]: /(.|\\n){{{lo},{hi}}}/"]
    if "string" in kinds or ("$ref" in json.dumps(schema) and not defs):
        return None
    return f"%json {_json_arg({**schema, **defs})} {_lark_text(_XML_END)}", []


def _xml_call_rules(tool: Tool, i: int) -> list[str] | None:
    """Rule ``fn_<i>``: one call of ``tool`` in the XML form (``<function=NAME>`` then a ``<parameter=KEY>`` block
    per argument, in the schema's order, the optional ones optional), or None if an argument has no XML form."""
    params = {"type": "object", **tool.parameters}
    props = params.get("properties", {})
    required = params.get("required", [])
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    if not isinstance(props, dict) or not isinstance(required, list) or not set(required) <= set(props):
        return None
    rules, seq = [], []
    for j, (key, schema) in enumerate(props.items()):
        value = _xml_value_rule(schema, f"v_{i}_{j}", defs)
        if value is None or not re.fullmatch(r"[^<>\n]+", key):
            return None
        rules += [f"p_{i}_{j}: {_lark_text(f'<parameter={key}>' + chr(10))} {value[0]}", *value[1]]
        seq.append(f"p_{i}_{j}" + ("" if key in required else "?"))
    if not props and params.get("additionalProperties", True) is not False:  # an open object: any keys, raw values
        rules += [f'p_{i}_any: "<parameter=" /[A-Za-z0-9_.-]+/ ">\\n" v_{i}_any',
                  f"v_{i}_any[suffix={_lark_text(_XML_END)}]: /(.|\\n)*/"]
        seq.append(f"p_{i}_any*")
    head = _lark_text(f"<function={tool.name}>\n")
    return [f'fn_{i}: {head} {" ".join(seq)} "</function>\\n"', *rules]


def call_grammar(tools: Iterable[Tool], content: Grammar | None = None, xml: bool = False) -> Grammar:
    """One call of one of ``tools`` in its block (Lark with embedded JSON schemas), or, with ``content`` (a JSON
    output format), that JSON instead. ``xml`` (a template that teaches it: `teaches_xml_calls`): the call in the
    XML form, each value raw text up to its ``</parameter>`` (strings) or JSON by its schema (numbers, objects ...),
    as `read_xml_call` reads it; where an argument has no such form (a string with a pattern), the JSON form."""
    tools = list(tools)
    xml_rules = [_xml_call_rules(t, i) for i, t in enumerate(tools)] if xml else []
    xml = xml and all(r is not None for r in xml_rules)
    close = "</tool_call>" if xml else "\\n</tool_call>"  # an XML call's last line ends in its own newline
    lines = ["start: call | content" if content is not None else "start: call",
             'call: "<tool_call>\\n" (' + " | ".join(f"fn_{i}" for i in range(len(tools))) + f') "{close}"']
    if xml:
        lines += [line for rules in xml_rules for line in rules]
    else:
        lines += [f"fn_{i}: %json {_json_arg(call_schema(t))}" for i, t in enumerate(tools)]
    if content is not None:
        if content.kind not in ("json_schema", "json_object"):
            raise GrammarError(f"a {content.kind} output constraint cannot be combined with tools")
        schema = json.loads(content.text) if content.kind == "json_schema" else {"type": "object"}
        if not isinstance(schema, dict):
            raise GrammarError("a boolean JSON schema cannot be combined with tools")
        lines.append(f"content: %json {_json_arg(schema)}")
    return Grammar.lark("\n".join(lines))


# -- the request ------------------------------------------------------------------------------------------------

def _tool(raw: Any, where: str, nested: bool) -> Tool:
    """One tool: Chat Completions' {"type": "function", "function": {name, ...}} (``nested``) or Responses'
    {"type": "function", name, ...}."""
    if not isinstance(raw, dict):
        raise bad_request(f"'{where}' must be an object {{\"type\": \"function\", ...}}", param=where, code="invalid_value")
    if raw.get("type") != "function":
        raise unsupported(where, f"tools of type {raw.get('type')!r} (function tools only)")
    fn = raw.get("function") if nested else raw
    fwhere = f"{where}.function" if nested else where
    if not isinstance(fn, dict):
        raise bad_request(f"'{fwhere}' must be an object with the function's name and parameters", param=where,
                          code="invalid_value")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"'{fwhere}.name' must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
                          param=where, code="invalid_value")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"'{fwhere}.description' must be a string", param=where, code="invalid_value")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}  # a function without arguments
    if not isinstance(params, dict):
        raise bad_request(f"'{fwhere}.parameters' must be a JSON schema object", param=where, code="invalid_value")
    if params.get("type", "object") != "object":  # the arguments are a JSON object, named
        raise bad_request(f"'{fwhere}.parameters' of tool '{name}': function parameters must be an object schema "
                          f"(\"type\": \"object\"), got type {params['type']!r}", param=where, code="invalid_value")
    return Tool(name, description, params)


def _choice(raw: Any, names: set[str], has_tools: bool, nested: bool) -> tuple[str, str | None]:
    if raw is None:
        return "auto", None
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise bad_request(f"'tool_choice' must be auto, none, required or a function, got {raw!r}",
                              param="tool_choice", code="invalid_value")
        if raw == "required" and not has_tools:
            raise bad_request("'tool_choice' is required but no 'tools' are given: add the functions to 'tools'",
                              param="tool_choice", code="invalid_value")
        return raw, None
    name = None
    if isinstance(raw, dict) and raw.get("type") == "function":
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, dict) else raw.get("name")  # Chat Completions' or Responses' form
    if not isinstance(name, str):
        form = '{"type": "function", "function": {"name": ...}}' if nested else '{"type": "function", "name": ...}'
        raise bad_request(f"'tool_choice' must be auto, none, required or {form}", param="tool_choice",
                          code="invalid_value")
    if not has_tools:
        raise bad_request(f"'tool_choice' names the function '{name}' but no 'tools' are given: add it to 'tools'",
                          param="tool_choice", code="invalid_value")
    if name not in names:
        raise bad_request(f"'tool_choice' names the function '{name}', which is not among 'tools' "
                          f"({', '.join(sorted(names))}): name one of them", param="tool_choice", code="invalid_value")
    return "function", name


def parse_tools(body: dict[str, Any], engine: Any, nested: bool) -> ToolSet | None:
    """The request's tools and tool_choice (None without tools), each tool's parameters checked against the grammar
    engine (400 with its reason). ``nested``: Chat Completions' tool form, else Responses'."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise bad_request("'tools' must be a list of function tools", param="tools", code="invalid_value")
    tools = tuple(_tool(t, f"tools[{i}]", nested) for i, t in enumerate(raw or []))
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise bad_request(f"'tools' names the function '{dup}' twice: function names must be unique", param="tools",
                          code="invalid_value")
    choice, name = _choice(body.get("tool_choice"), set(names), bool(tools), nested)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be true or false", param="parallel_tool_calls",
                          code="invalid_value")
    if not tools:
        return None
    if choice != "none":
        for i, t in enumerate(tools):  # each alone, so that the error names the tool
            try:
                engine.grammars.compile(call_grammar([t]))
            except GrammarError as e:
                raise bad_request(f"the parameters schema of tool '{t.name}' cannot be used: {_reason(e)}",
                                  param=f"tools[{i}]", code="invalid_value") from None
    return ToolSet(tools, choice, name, True if parallel is None else parallel)


def request_grammar(tools: ToolSet | None, content: Grammar | None, content_param: str | None,
                    engine: Any) -> Grammar | None:
    """The grammar a request with ``tools`` samples under: a forced call's, or for "auto" with a JSON output format,
    a call or that JSON; else ``content`` (the output format's, `protocol.request_grammar`). A forced call has no
    content, so its output format does not apply."""
    if tools is None or not tools.active:
        return content
    xml = teaches_xml_calls(engine.tokenizer)
    if tools.forced:
        grammar = call_grammar(tools.forced, xml=xml)
    elif content is None:
        return None
    else:
        try:
            grammar = call_grammar(tools.tools, content, xml=xml)
        except GrammarError as e:
            raise bad_request(f"{e}: remove '{content_param}' or set tool_choice to none", param=content_param,
                              code="invalid_value") from None
    try:
        engine.grammars.compile(grammar)
    except GrammarError as e:
        raise bad_request(f"the tools cannot be used: {_reason(e)}", param="tools", code="invalid_value") from None
    return grammar


def _reason(e: GrammarError) -> str:
    """llguidance's reason for refusing a call grammar, without the grammar (onecopy's internal Lark, which the
    request never wrote): "failed to compile JSON schema: Invalid type: strin"."""
    first = str(e).split("\n", 1)[0].removeprefix("the lark cannot be compiled: ")
    return re.sub(r"^at \d+\(\d+\): ", "", first)


# -- messages ---------------------------------------------------------------------------------------------------

def chat_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A call in Chat Completions' form (an assistant message's ``tool_calls`` entry)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def check_tool_calls(raw: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as given ([{id, type: function, function: {name, arguments}}])."""
    if not isinstance(raw, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            and isinstance(c["function"].get("arguments", ""), str) for c in raw):
        raise bad_request(f"'{where}' must be a list of {{id, type: function, function: {{name, arguments}}}} with "
                          "arguments as a JSON string", param=where, code="invalid_value")
    return [chat_call(str(c.get("id") or new_call_id()), c["function"]["name"], c["function"].get("arguments") or "{}")
            for c in raw]


def block(name: str, arguments: str) -> str:
    """A call as the model writes it (compact, as a constrained call is generated: the rendered history then
    matches the tokens the conversation holds, and a kept conversation continues)."""
    return f'{OPEN}\n{{"name":{json.dumps(name)},"arguments":{arguments}}}\n{CLOSE}'


# Short: a small model's context is short (SmolLM2's bundles in the tests have 256 positions)
SYSTEM_TOOLS = """# Tools

Functions you may call, within <tools></tools>:
<tools>
{tools}
</tools>
To call one, answer with its name and arguments as JSON:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates that know tools take them (transformers' form: a call's arguments as an object)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                try:
                    args = json.loads(c["function"]["arguments"])
                except json.JSONDecodeError:
                    args = c["function"]["arguments"]
                calls.append({**c, "function": {"name": c["function"]["name"], "arguments": args}})
            m["tool_calls"] = calls
        out.append(m)
    return out


def _plain_messages(messages: list[dict[str, Any]], tools: ToolSet | None) -> list[dict[str, str]]:
    """Messages for a template that knows only roles and text: calls as blocks in the assistant's text, tool results
    as <tool_response> blocks in a user turn (consecutive ones in one), the tools in the system prompt."""
    out: list[dict[str, str]] = []
    results = False  # the last message out is a user turn of tool results
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if results:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
            results = True
            continue
        content = m["content"]
        if m.get("tool_calls"):
            calls = "\n".join(block(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": m["role"], "content": content})
        results = False
    if tools is not None and tools.active:
        specs = (json.dumps(t.spec()["function"], separators=(",", ":"), ensure_ascii=False) for t in tools.tools)
        text = SYSTEM_TOOLS.format(tools="\n".join(specs))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: ToolSet | None) -> str:
    """The prompt of ``messages`` (role, content, and an assistant's ``tool_calls`` or a tool's ``tool_call_id``)."""
    if tokenizer.takes_tools:
        shown = [t.spec() for t in tools.tools] if tools is not None and tools.active else None
        return tokenizer.apply_chat_template(_template_messages(messages), tools=shown)
    return tokenizer.apply_chat_template(_plain_messages(messages, tools))


# -- the reply --------------------------------------------------------------------------------------------------

def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Text:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class Arguments:
    index: int
    text: str


@dataclass
class CallEnd:
    index: int


@dataclass
class CallFailed:
    """A call already announced (`CallStart` and its arguments sent) that is no call after all: its block does not
    hold a JSON object of object arguments, or the reply ended inside it. ``text`` is the block as generated (with the
    whitespace held before it): reply text, where a whole reply has it in its content."""

    index: int
    text: str


Event = Text | CallStart | Arguments | CallEnd | CallFailed


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""
    raw: str = OPEN  # the block's text as generated (given back as text when it is no call)
    status: str = "open"  # open | complete | failed

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    def item(self) -> dict[str, Any]:
        """The call in Chat Completions' form."""
        return chat_call(self.id, self.name, self.arguments)


def _object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@dataclass
class CallParser:
    """Reply text in (as it streams), text and calls out as `Event`s.

    Text that may start ``<tool_call>`` is held back, and so is whitespace before it until its block is settled (a
    call drops it, a block that is text gives it back). A block settles at its ``</tool_call>`` (outside a JSON
    string) or at the end of the reply: it is a call when it holds ``{"name": <a tool>, "arguments": {...}}`` with
    arguments that parse as a JSON object (at the reply's end, complete arguments suffice), else it is text, as
    generated. Text beside calls is stripped and its pieces are joined with newlines; a reply without calls is
    exactly as generated.

    ``eager``: a call whose block starts ``{"name": "<a tool>", "arguments": {`` is announced there and its arguments
    stream as they come (for a constrained reply, whose grammar keeps a call valid: only the reply's end can cut
    it); should it still fail, `CallFailed` gives its text back. Otherwise (free generation) a call's events come
    when its block is settled, so that a stream never announces a call that turns out to be text."""

    names: set[str]
    eager: bool = True
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # a tool's argument schema (XML-form values)
    bare: bool = False  # a reply that is only JSON calls (Llama 3.1's form) is read as calls (free generation)
    calls: list[Call] = field(default_factory=list)  # the calls announced, in order (their index), failed ones too
    # text | head (after OPEN) | args | tail (after the arguments) | raw (read whole) | bare (a reply of JSON calls)
    _state: str = "text"
    _buf: str = ""
    _ws: str = ""  # trailing whitespace of the text, held until more text follows
    _block_ws: str = ""  # the whitespace before the open block, held until it is settled
    _after_call: bool = False  # the last thing settled was a call: the text that follows is stripped
    _lead: bool = True  # nothing but whitespace read yet (where a bare reply would start)
    _said: bool = False  # some text was emitted
    _called: bool = False  # some call completed
    _call: Call | None = None  # the call being read (args, tail)
    _rest: str = ""  # the call's text between its arguments and its CLOSE
    _args_done: bool = False
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def push(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            before = (self._state, len(self._buf))
            getattr(self, f"_{self._state}")(out)
            if (self._state, len(self._buf)) == before:
                return out

    def flush(self) -> list[Event]:
        """The end of the reply: held text given back, the open block settled."""
        out: list[Event] = []
        if self._state == "text":
            self._emit(out, self._buf, final=True)
        elif self._state == "bare":
            calls = read_bare_calls(self._buf, self.names)
            for call in calls or ():
                self._complete(out, call, announced=False)
            if not calls:
                self._emit(out, self._buf, final=True)
        elif self._state in ("head", "raw"):
            self._block_text(out, OPEN + self._buf, final=True)
        else:  # inside a call
            self._call.raw += self._buf
            if self._state == "tail":
                self._rest += self._buf
            self._buf = ""
            self._settle(out, final=True)
        self._buf, self._block_ws, self._state = "", "", "text"
        return out

    def _emit(self, out: list[Event], text: str, final: bool = False) -> None:
        if self._after_call:
            text = text.lstrip()
        text, self._ws = self._ws + text, ""
        if not final:
            core = text.rstrip()
            text, self._ws = core, text[len(core):]
        elif self._called:
            text = text.rstrip()
        if text:
            if self._after_call and self._said:
                text = "\n" + text  # the text pieces around a call, one per line
            self._after_call, self._said = False, True
            out.append(Text(text))

    def _text(self, out: list[Event]) -> None:
        if self._lead and self.bare:  # a reply that starts as JSON (or the tag) is held to its end: calls or text
            lead = self._buf.lstrip()
            if lead.startswith(("{", PYTHON_TAG)):
                self._state = "bare"
                return
            if not lead or PYTHON_TAG.startswith(lead):
                return
        self._lead = self._lead and not self._buf.strip()
        i = self._buf.find(OPEN)
        if i >= 0:
            self._emit(out, self._buf[:i])
            self._block_ws, self._ws = self._ws, ""
            self._buf, self._state = self._buf[i + len(OPEN):], "head"
            return
        keep = next((k for k in range(min(len(OPEN) - 1, len(self._buf)), 0, -1) if self._buf.endswith(OPEN[:k])), 0)
        cut = len(self._buf) - keep
        if cut:
            self._emit(out, self._buf[:cut])
            self._buf = self._buf[cut:]

    def _announce(self, out: list[Event], call: Call) -> int:
        self.calls.append(call)
        out.append(CallStart(len(self.calls) - 1, call.id, call.name))
        return len(self.calls) - 1

    def _head(self, out: list[Event]) -> None:
        m = _HEAD.match(self._buf)
        if m is not None:
            name = json.loads(m.group(1))
            if name in self.names:
                self._call = Call(new_call_id(), name, raw=OPEN + self._buf[:m.end()])
                self._buf, self._state, self._rest = self._buf[m.end():], "args", ""
                self._depth, self._in_string, self._escaped, self._args_done = 0, False, False, False
                if self.eager:
                    self._announce(out, self._call)
                return
        if m is not None or CLOSE in self._buf or len(self._buf.lstrip()) > _HEAD_MAX:
            self._state = "raw"

    def _args(self, out: list[Event]) -> None:
        """The arguments object, to its closing brace (then `_tail`) or to a CLOSE outside a JSON string (cut short:
        settled, as text)."""
        buf, end, closed = self._buf, None, False
        for i, ch in enumerate(buf):
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                self._in_string = True
            elif ch == "<" and (buf.startswith(CLOSE, i) or CLOSE.startswith(buf[i:])):
                end, closed = i, buf.startswith(CLOSE, i)  # the tag, or what may be its start: wait for more
                break
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end, self._args_done = i + 1, True
                    break
        piece = buf[:end] if end is not None else buf
        call = self._call
        if piece:
            call.arguments += piece
            call.raw += piece
            if self.eager:
                out.append(Arguments(len(self.calls) - 1, piece))
        self._buf = buf[len(piece):]
        if self._args_done:
            self._state = "tail"
        elif closed:
            call.raw += CLOSE
            self._buf = self._buf[len(CLOSE):]
            self._settle(out)

    def _tail(self, out: list[Event]) -> None:
        j = self._buf.find(CLOSE)
        if j < 0:
            return
        self._rest += self._buf[:j]
        self._call.raw += self._buf[:j + len(CLOSE)]
        self._buf = self._buf[j + len(CLOSE):]
        self._settle(out)

    def _valid(self, call: Call) -> bool:
        """Complete arguments that are a JSON object, and after them the call's closing brace (or nothing, or the
        rest of a JSON object: other keys)."""
        if not self._args_done or not _object(call.arguments):
            return False
        return self._rest.strip() in ("", "}") or _object(call.raw[len(OPEN):].removesuffix(CLOSE))

    def _complete(self, out: list[Event], call: Call, announced: bool) -> None:
        """``call``'s block is a call: its events (those not sent as it streamed) and the whitespace around it dropped."""
        index = len(self.calls) - 1 if announced else self._announce(out, call)
        if not announced:
            out.append(Arguments(index, call.arguments))
        call.status = "complete"
        out.append(CallEnd(index))
        self._block_ws, self._ws, self._after_call, self._called = "", "", True, True

    def _block_text(self, out: list[Event], raw: str, final: bool = False) -> None:
        """A block that is no call: its text as generated, with the whitespace held before it."""
        self._emit(out, self._block_ws + raw, final)
        self._block_ws = ""

    def _settle(self, out: list[Event], final: bool = False) -> None:
        """The block of the call being read is over: a call, or text."""
        call, self._call, self._state = self._call, None, "text"
        announced = bool(self.calls) and self.calls[-1] is call
        if self._valid(call):
            self._complete(out, call, announced)
            return
        text: list[Event] = []
        self._block_text(text, call.raw, final)
        if announced:
            call.status = "failed"
            out.append(CallFailed(len(self.calls) - 1, "".join(t.text for t in text)))
        else:
            out += text

    def _bare(self, out: list[Event]) -> None:
        """A reply that may be bare JSON calls: held whole (settled by `flush`)."""

    def _raw(self, out: list[Event]) -> None:
        j = self._buf.find(CLOSE)
        if j < 0:
            return
        inner, self._buf, self._state = self._buf[:j], self._buf[j + len(CLOSE):], "text"
        call = self._read_whole(inner)
        if call is None:
            self._block_text(out, OPEN + inner + CLOSE)
        else:
            self._complete(out, call, announced=False)

    def _read_whole(self, inner: str) -> Call | None:
        try:
            obj = json.loads(inner)
        except json.JSONDecodeError:
            xml = read_xml_call(inner, self.names, self.params)
            return None if xml is None else Call(new_call_id(), xml[0], json.dumps(xml[1], ensure_ascii=False),
                                                 OPEN + inner + CLOSE)
        args = call_arguments(obj, self.names, ("arguments", "parameters"), {})
        return None if args is None else Call(new_call_id(), obj["name"], args, OPEN + inner + CLOSE)


def call_arguments(obj: Any, names: set[str], keys: tuple[str, str], default: Any = None) -> str | None:
    """The arguments (compact JSON text) of a call written as a JSON object ``{"name": <a tool in names>, <keys[0]
    or keys[1], the first present; else default>: an object, or its JSON text}``; None if ``obj`` is no such call."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = next((obj[k] for k in keys if k in obj), default)
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def read_bare_calls(text: str, names: set[str]) -> list[Call] | None:
    """The calls of a reply that is nothing but calls in Llama 3.1's form: after an optional ``<|python_tag|>``, JSON
    objects ``{"name": <a tool>, "parameters" (or "arguments"): {...}}``, separated by whitespace or ``;``; else None."""
    rest, calls, decoder = text.strip().removeprefix(PYTHON_TAG), [], json.JSONDecoder()
    while rest.strip():
        rest = rest.strip()
        try:
            obj, end = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            return None
        args = call_arguments(obj, names, ("parameters", "arguments"))
        if args is None or set(obj) - {"name", "parameters", "arguments"}:
            return None
        calls.append(Call(new_call_id(), obj["name"], args, rest[:end]))
        rest = rest[end:].lstrip().removeprefix(";")
    return calls or None


# Qwen3.5's / Qwen3-Coder's call: <function=NAME> then <parameter=KEY>VALUE</parameter> blocks, the values raw text
_XML_CALL = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def read_xml_call(inner: str, names: set[str], params: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of a block that is one XML-form call of a tool in ``names`` (nothing but parameters in its
    function), each value typed by that tool's argument schema in ``params`` (`xml_value`); else None."""
    m = _XML_CALL.fullmatch(inner)
    if m is None or m.group(1).strip() not in names:
        return None
    name, body = m.group(1).strip(), m.group(2)
    props = params.get(name, {}).get("properties", {})
    args: dict[str, Any] = {}
    end = 0
    for p in _XML_PARAM.finditer(body):
        if body[end:p.start()].strip():
            return None  # text between the parameters: not a call
        key, value = p.group(1).strip(), p.group(2)
        value = value[1:] if value.startswith("\n") else value  # the template's newlines around a value
        value = value[:-1] if value.endswith("\n") else value
        args[key] = xml_value(value, props.get(key) if isinstance(props, dict) else None)
        end = p.end()
    return (name, args) if not body[end:].strip() else None


def xml_value(text: str, schema: Any) -> Any:
    """An XML-form parameter's value as its schema types it: a string as written (also without a schema, or when the
    text is no value of the type), an integer / number / boolean / null from its literal, an object or array (or a
    schema of another kind) from JSON or, as models also write them, a Python literal."""
    kinds = schema.get("type") if isinstance(schema, dict) else "string"
    kinds = [k for k in (kinds if isinstance(kinds, list) else [kinds]) if k != "null"] or ["null"]
    kind = kinds[0] if len(kinds) == 1 else None  # None: several types (or none named): whichever the text is
    if kind == "string" or (kind is None and isinstance(schema, dict) and not schema):
        return text
    word = text.strip()
    if word.lower() == "null":
        return None
    if kind == "boolean":
        return {"true": True, "false": False}.get(word.lower(), text)
    if kind in ("integer", "number"):
        try:
            number = json.loads(word)
        except json.JSONDecodeError:
            return text
        ok = isinstance(number, int) if kind == "integer" else isinstance(number, (int, float))
        return number if ok and not isinstance(number, bool) and math.isfinite(number) else text  # no NaN: not JSON
    try:
        return json.loads(word)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(word)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


@dataclass
class ParsedReply:
    """A whole reply: its text outside calls (None if empty; blocks that are no call included, as generated) and its
    calls."""

    content: str | None
    calls: list[Call]


def parse_reply(text: str, names: set[str], params: dict[str, dict[str, Any]] | None = None,
                bare: bool = False) -> ParsedReply:
    """``text`` split into content and calls, as `CallParser` streams them (either way of announcing calls gives
    the same content and calls)."""
    parser = CallParser(names, params=params or {}, bare=bare)
    events = parser.push(text) + parser.flush()
    content = "".join(e.text for e in events if isinstance(e, (Text, CallFailed)))
    return ParsedReply(content or None, [c for c in parser.calls if c.complete])
