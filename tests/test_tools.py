"""Tools (function calling): tools rendered into the prompt, forced calls constrained to their schema, calls parsed
from the reply (streamed as deltas), in Chat Completions and Responses, with the official openai client on SmolLM2
(`onecopy.serve.tools`)."""

import json

import httpx
import openai
import pytest

from onecopy.serve.tools import (Arguments, CallEnd, CallFailed, CallParser, CallStart, Text, Tool, ToolSet,
                                 call_schema, parse_reply, render, xml_value)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "A city's weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _validate(args: dict, schema: dict) -> None:
    """``args`` against a tool's ``schema``: jsonschema's check where installed (ray[serve], a test extra, brings
    it), else by hand for the objects of flat typed, enum and bounded-string properties these tests use."""
    try:
        import jsonschema
    except ImportError:
        props = schema["properties"]
        assert set(schema["required"]) <= set(args) <= set(props), args
        for k, v in args.items():
            p = props[k]
            assert "enum" not in p or v in p["enum"], (k, v)
            assert p.get("type") != "string" or (isinstance(v, str) and len(v) <= p.get("maxLength", len(v))), (k, v)
            assert p.get("type") != "integer" or (isinstance(v, int) and not isinstance(v, bool)), (k, v)
        return
    jsonschema.validate(args, schema)


def _responses_tool(t: dict) -> dict:
    return {"type": "function", **t["function"]}


def _check_call(call, name: str | None = None) -> dict:
    """A parsed call: its name (``name`` if given) and its arguments valid against that tool's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in SCHEMAS and (name is None or call.function.name == name), call
    args = json.loads(call.function.arguments)
    _validate(args, SCHEMAS[call.function.name])
    return args


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# -- the parser and the renderer, on crafted text ----------------------------------------------------------------

NAMES = {"get_weather", "add"}
REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris \\"x\\"", "unit": '
         '"celsius"}}\n</tool_call>\n<tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}\n</tool_call>\n'
         '<tool_call>not json</tool_call>\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>')


def _streamed(text: str, size: int, eager: bool, bare: bool = False) -> tuple[CallParser, list]:
    parser = CallParser(NAMES, eager, params=SCHEMAS, bare=bare)
    return parser, [e for i in range(0, len(text), size) for e in parser.push(text[i:i + size])] + parser.flush()


def _agrees(text: str, bare: bool = False) -> tuple[str | None, list[tuple[str, dict]]]:
    """The whole reply's content and calls, checked to be what a stream of it gives in pieces of any size, calls
    announced eagerly or once settled (the content being its text events and the text of failed calls)."""
    whole = parse_reply(text, NAMES, SCHEMAS, bare)
    calls = [(c.name, c.arguments) for c in whole.calls]
    for eager in (True, False):
        for size in (1, 2, 3, 7, len(text) or 1):
            parser, events = _streamed(text, size, eager, bare)
            content = "".join(e.text for e in events if isinstance(e, (Text, CallFailed)))
            assert (content or None) == whole.content, (eager, size, content)
            assert [(c.name, c.arguments) for c in parser.calls if c.complete] == calls, (eager, size)
            assert [e.name for e in events if isinstance(e, CallStart)] == [c.name for c in parser.calls]
            if not eager:  # settled first: a call's events together, no failed call ever announced
                assert not any(isinstance(e, CallFailed) for e in events)
                starts = [k for k, e in enumerate(events) if isinstance(e, CallStart)]
                assert all(isinstance(events[k + 1], Arguments) and isinstance(events[k + 2], CallEnd) for k in starts)
    return whole.content, [(name, json.loads(args)) for name, args in calls]


def test_parser_splits_text_and_calls_whatever_the_pieces():
    content, calls = _agrees(REPLY)
    assert calls == [("get_weather", {"city": 'Pa}ris "x"', "unit": "celsius"}), ("add", {"a": 1, "b": 2})]
    # malformed blocks and unknown tools stay text, with the whitespace before them; text beside calls is stripped,
    # its pieces one per line
    assert content == ('Let me check.\n<tool_call>not json</tool_call>\n<tool_call>{"name": "nope", "arguments": {}}'
                       '</tool_call>')
    for size in (1, 3, 7):  # streamed in pieces: the first call's arguments as they come
        parser, events = _streamed(REPLY, size, eager=True)
        first = next(k for k, e in enumerate(events) if isinstance(e, CallStart))
        assert "".join(e.text for e in events[:first]) == "Let me check."  # the tag and the newline held back
        assert sum(isinstance(e, Arguments) and e.index == 0 for e in events) > 3 // size + 1
        assert sum(isinstance(e, CallEnd) for e in events) == 2
    assert parse_reply("no calls, a < b and <tool", NAMES).content == "no calls, a < b and <tool"
    assert parse_reply("  spaced  ", NAMES).content == "  spaced  "  # text without calls: exactly as generated


def _xml_block(name: str, *params: tuple[str, str], stray: str = "") -> str:
    """A call in the XML form of Qwen3.5's chat template."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{stray}{body}</function>\n</tool_call>"


def test_parser_reads_xml_form_calls_with_values_typed_by_their_schemas():
    """Qwen3.5's template has its model write calls as <function=...> / <parameter=...> blocks: read like the JSON
    form, whole pieces or streamed, each value typed by the tool's schema (a string as written, newlines inside
    kept); a block with text between its parameters, or of an unknown tool, stays text."""
    stray = _xml_block("add", ("a", "1"), stray="stray words\n")
    unknown = _xml_block("nope")
    reply = ("Checking.\n" + _xml_block("get_weather", ("city", "New\nYork "), ("unit", "celsius")) + "\n"
             + _xml_block("add", ("a", "2"), ("b", "-40")) + "\n" + stray + unknown)
    content, calls = _agrees(reply)
    assert calls == [("get_weather", {"city": "New\nYork ", "unit": "celsius"}), ("add", {"a": 2, "b": -40})]
    assert content == "Checking.\n" + stray + unknown
    assert parse_reply(_xml_block("add", ("a", "2"), ("b", "x")), NAMES, SCHEMAS).calls[0].arguments == \
        '{"a": 2, "b": "x"}'  # not an integer: the text, for the caller's own check (as a JSON call's would be)


def test_parser_reads_a_reply_of_bare_json_calls_in_free_generation():
    """Llama 3.1's templates have its model answer a call as the whole reply: JSON objects {"name", "parameters"}
    (after <|python_tag|>, separated by ";"). A free reply that is nothing else is those calls, settled at its end,
    whatever the pieces; one with anything else (other text, other keys, an unknown tool) is text as generated; a
    reply that does not start as JSON streams as before, and without ``bare`` (a constrained turn) nothing changes."""
    two = ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "arguments": '
           '"{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}')
    assert _agrees(two, bare=True) == (None, [("add", {"a": 1, "b": 2}),
                                             ("get_weather", {"city": "Paris", "unit": "celsius"})])
    assert _agrees(' \n{"name": "add", "parameters": {"a": 3}}\n', bare=True) == (None, [("add", {"a": 3})])
    for text in ('{"name": "nope", "parameters": {}}', '{"answer": 42}', '{"name": "add", "parameters": {"a": 1}} ok',
                 '{"name": "add", "parameters": {"a": 1}, "id": 7}', "Sure: " + two, "<|python_tag|>print(1)", "<|py",
                 "  "):
        assert _agrees(text, bare=True) == (text or None, []), text
        assert _agrees(text) == (text or None, []), text
    assert _agrees(two) == (two, [])
    parser, events = _streamed("<tool_call>" + REPLY.split("<tool_call>", 1)[1], 4, eager=False, bare=True)
    assert [c.name for c in parser.calls if c.complete] == ["get_weather", "add"]  # a block first: as before


def test_xml_values_take_their_schema_types():
    cases = [("42", {"type": "integer"}, 42), ("4.5", {"type": "integer"}, "4.5"), ("4.5", {"type": "number"}, 4.5),
             ("-3", {"type": "number"}, -3), ("True", {"type": "boolean"}, True), ("maybe", {"type": "boolean"}, "maybe"),
             ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}), ("{'a': 1}", {"type": "object"}, {"a": 1}),
             ("[1, 2]", {"type": "array"}, [1, 2]), ("null", {"type": "integer"}, None), ("null", {"type": "string"}, "null"),
             ("7", None, "7"), ("7", {}, "7"), ("a", {"enum": ["a", "b"]}, "a"), ("2", {"enum": [1, 2]}, 2),
             ("null", {"type": ["integer", "null"]}, None), ("3", {"type": ["integer", "null"]}, 3),
             ("x", {"type": ["integer", "string"]}, "x"), (" 3 ", {"type": ["integer", "string"]}, 3),
             ("{not json", {"type": "object"}, "{not json"), ("NaN", {"type": "number"}, "NaN")]
    for text, schema, want in cases:
        got = xml_value(text, schema)
        assert got == want and type(got) is type(want), (text, schema, got)


CALL = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'


@pytest.mark.parametrize("reply, content, calls", [
    # settled at the reply's end: complete object arguments are a call, anything less is text
    ('<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}', None, [("add", {"a": 1, "b": 2})]),
    ('Sure.\n<tool_call>\n{"name":"add","arguments":{"a":1}}\n', "Sure.", [("add", {"a": 1})]),
    ('Sure. <tool_call>\n{"name":"add","arguments":{"a":1,', 'Sure. <tool_call>\n{"name":"add","arguments":{"a":1,',
     []),
    ("ok <tool_call>", "ok <tool_call>", []),
    # settled at </tool_call> outside a JSON string: what follows is text again
    ('<tool_call>\n{"name":"add","arguments":{"a":1\n</tool_call>\nThe answer follows.',
     '<tool_call>\n{"name":"add","arguments":{"a":1\n</tool_call>\nThe answer follows.', []),
    ('<tool_call>\n{"name":"add","arguments":{"s":"</tool_call>"}}\n</tool_call>', None, [("add", {"s": "</tool_call>"})]),
    # arguments that are no JSON object, though their brackets balance: text
    ('<tool_call>\n{"name":"add","arguments":{"a": tru, "b": [1,}}\n</tool_call>', "=", []),
    ("<tool_call>\n{\"name\":\"add\",\"arguments\":{'a': 1}}\n</tool_call>", "=", []),
    ('<tool_call>\n{"name":"add","arguments":{"a": [1}]}\n</tool_call>', "=", []),
    ('<tool_call>\n{"name":"add","arguments":{"a":1}}}\n</tool_call>', "=", []),
    ('<tool_call>\n{"name":"add","arguments":[1,2]}\n</tool_call>', "=", []),
    ('<tool_call>\n{"name":"add","arguments":{"a":1}, "id": 5}\n</tool_call>', None, [("add", {"a": 1})]),
    # text that is no call comes back as generated; text between calls one piece a line
    ("Use the <tool_call> tag to call a tool. " + "x" * 300, "=", []),
    (f"{CALL} and then {CALL} done \n", "and then\ndone", [("add", {"a": 1, "b": 2})] * 2),
    (f"First.\n\n{CALL}\n\n<tool_call>oops</tool_call>", "First.\n<tool_call>oops</tool_call>",
     [("add", {"a": 1, "b": 2})]),
])
def test_a_block_is_a_call_only_with_object_arguments_and_else_text_as_generated(reply, content, calls):
    assert _agrees(reply) == (reply if content == "=" else content, calls)


def test_a_call_announced_that_fails_gives_its_text_back():
    """Eagerly (a constrained reply) a call is announced at its name: cut short after that, its text comes back as
    `CallFailed` (with the whitespace held before it); settled first, it is plain text and never announced."""
    reply = 'Sure. <tool_call>\n{"name":"add","arguments":{"a":1,'
    parser, events = _streamed(reply, 4, eager=True)
    assert [type(e) for e in events if not isinstance(e, Arguments)] == [Text, Text, CallStart, CallFailed]
    assert "".join(e.text for e in events if isinstance(e, Text)) == "Sure."
    assert events[-1] == CallFailed(0, ' <tool_call>\n{"name":"add","arguments":{"a":1,')
    assert [c.status for c in parser.calls] == ["failed"]
    parser, events = _streamed(reply, 4, eager=False)
    assert parser.calls == [] and "".join(e.text for e in events) == reply


def test_tools_render_in_the_system_prompt_and_the_history_as_blocks(smol_engine):
    tools = ToolSet((Tool("add", "Add.", SCHEMAS["add"]),))
    tok = smol_engine.tokenizer
    assert not tok.takes_tools  # SmolLM2's template knows no tools: onecopy renders them
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"},
               {"role": "tool", "tool_call_id": "call_2", "content": "4"}]
    text = render(tok, history, tools)
    assert "<|im_start|>system\nBe brief.\n\n# Tools\n" in text and '{"name":"add","description":"Add."' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response><|im_end|>" in text
    assert "# Tools" not in render(tok, history, ToolSet(tools.tools, "none"))  # none: not shown


def test_a_template_that_knows_tools_renders_them():
    from onecopy.tokenizer import Tokenizer

    tok = Tokenizer.__new__(Tokenizer)
    tok.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                         "{% for c in m.tool_calls or [] %}<{{ c.function.arguments.a }}>{% endfor %}{% endfor %}")
    assert tok.takes_tools
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 5}'}}]}]
    assert render(tok, msgs, ToolSet((Tool("add", None, {}),))) == "[add]<5>"  # arguments as an object


def test_templates_get_transformers_tojson():
    """Key order kept, non-ASCII and <>&' as they are (Jinja's own filter sorts keys and escapes them)."""
    from onecopy.tokenizer import Tokenizer

    tok = Tokenizer.__new__(Tokenizer)
    tok.chat_template = ("{% for t in tools %}{{ t | tojson }}{% endfor %}{% for m in messages %}"
                         "{% for c in m.tool_calls or [] %}|{{ c.function.arguments | tojson(indent=1) }}{% endfor %}"
                         "{% endfor %}")
    tool = Tool("w", "Météo <city> & 'more'", {"type": "object", "properties": {"z": {}, "a": {}}})
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "w", "arguments": '{"z": "Zürich", "a": "<b>"}'}}]}]
    assert render(tok, msgs, ToolSet((tool,))) == (
        '{"type": "function", "function": {"name": "w", "description": "Météo <city> & \'more\'", "parameters": '
        '{"type": "object", "properties": {"z": {}, "a": {}}}}}|{\n "z": "Zürich",\n "a": "<b>"\n}')


def test_parameters_must_be_an_object_schema_and_may_leave_it_open():
    from onecopy.serve.errors import APIError
    from onecopy.serve.tools import parse_tools

    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    with pytest.raises(APIError) as e:
        parse_tools({"tools": [fn], "tool_choice": "required"}, None, nested=True)
    assert e.value.status == 400 and "function parameters must be an object schema" in e.value.message
    # {} (or no type) is any object: the forced call's arguments are still an object
    assert call_schema(Tool("f", None, {}))["properties"]["arguments"] == {"type": "object"}
    assert call_schema(Tool("f", None, {"properties": {"a": {}}}))["properties"]["arguments"] == {
        "type": "object", "properties": {"a": {}}}


def test_a_bad_tool_choice_is_named_in_the_api_s_own_form():
    from onecopy.serve.errors import APIError
    from onecopy.serve.tools import parse_tools

    for nested, form in ((True, '{"type": "function", "function": {"name": ...}}'),
                         (False, '{"type": "function", "name": ...}')):
        tool = WEATHER if nested else _responses_tool(WEATHER)
        with pytest.raises(APIError) as e:
            parse_tools({"tools": [tool], "tool_choice": {"type": "function"}}, None, nested=nested)
        assert e.value.message.endswith(form), e.value.message


def test_a_responses_function_call_item_without_arguments_has_an_empty_object():
    from onecopy.serve.responses import _item_messages

    item = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": ""}
    assert _item_messages([item], [])[0]["tool_calls"][0]["function"]["arguments"] == "{}"  # as Chat's check


def test_definitions_move_to_the_root_of_a_call():
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}
    schema = call_schema(Tool("f", None, params))
    assert schema["$defs"] == {"P": {"type": "integer"}} and "$defs" not in schema["properties"]["arguments"]


# -- Chat Completions ------------------------------------------------------------------------------------------

def test_forced_and_required_calls_match_their_schema(smol_server):
    client = _client(smol_server)
    forced = {"type": "function", "function": {"name": "get_weather"}}
    done = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=forced,
                                          max_tokens=40, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], "get_weather")
    # the same streamed: the first delta names the call, the arguments follow in pieces; the client accumulates them
    with client.chat.completions.stream(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=forced,
                                        max_tokens=40, temperature=0) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 2
    assert all(d.index == 0 and d.function.name is None for d in deltas[1:])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    call = final.choices[0].message.tool_calls[0]
    assert _check_call(call, "get_weather") == json.loads(choice.message.tool_calls[0].function.arguments)
    # required, two tools: one call of either
    done = client.chat.completions.create(model="smollm2", tools=TOOLS, tool_choice="required", max_tokens=40,
                                          temperature=0, messages=[{"role": "user", "content": "What is 17 plus 25?"}])
    assert done.choices[0].finish_reason == "tool_calls"
    _check_call(done.choices[0].message.tool_calls[0])


def test_auto_none_and_a_history_with_tool_results(smol_server):
    client = _client(smol_server)
    done = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=40, temperature=0)
    choice = done.choices[0]
    if choice.message.tool_calls:  # the model chose to call: valid calls
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            _check_call(call)
    else:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    done = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=20, temperature=0)
    assert done.choices[0].message.tool_calls is None and done.choices[0].finish_reason in ("stop", "length")
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    done = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, tool_choice="none",
                                          max_tokens=30, temperature=0)
    assert done.choices[0].message.content and done.choices[0].finish_reason in ("stop", "length")


def test_a_call_cut_by_max_tokens_is_no_call(smol_server):
    """Chat: the cut block is content. A stream has already sent the call's deltas (a forced call streams its
    arguments as generated); it then sends the block as content: the same content and finish_reason."""
    client = _client(smol_server)
    forced = {"type": "function", "function": {"name": "get_weather"}}
    done = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=forced,
                                          max_tokens=18, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith('<tool_call>\n{"name":"get_weather","arguments":{'), choice.message.content
    chunks = list(client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=forced,
                                                 max_tokens=18, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[1].tool_calls[0].function.name == "get_weather"
    assert "".join(d.content or "" for d in deltas) == choice.message.content


def test_responses_a_call_cut_by_max_output_tokens_is_an_incomplete_function_call(smol_server):
    """Responses: the cut call is a function_call item with status incomplete, streamed or not (as OpenAI's API
    gives it), in an incomplete response."""
    client = _client(smol_server)
    # (another city than the next test's: this reply's blocks, published, must not be the start of that one's)
    ask = dict(model="smollm2", input="What is the weather like in Rome today?", tools=[_responses_tool(WEATHER)],
               max_output_tokens=18, tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    whole = client.responses.create(**ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [(o.type, o.status, o.name) for o in whole.output] == [("function_call", "incomplete", "get_weather")]
    assert whole.output[0].arguments.startswith("{") and not _object(whole.output[0].arguments)
    events = list(client.responses.create(**ask, stream=True))
    assert events[-1].type == "response.incomplete"
    streamed = events[-1].response
    assert [o.model_dump(exclude={"id", "call_id"}) for o in streamed.output] == [
        o.model_dump(exclude={"id", "call_id"}) for o in whole.output]
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"
    assert client.responses.retrieve(streamed.id).output[0].status == "incomplete"


def _object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


TOOL_ERRORS = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'tool_choice' names the function 'nope', which is not among 'tools' (add, get_weather)"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "no 'tools' are given"),
    ({"tools": None, "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice",
     "names the function 'add' but no 'tools' are given"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be auto, none, required or a function"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "strin"}}}}}]},
     "tools[0]", "the parameters schema of tool 'f' cannot be used: failed to compile JSON schema: Invalid type: strin"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools[0]",
     "function parameters must be an object schema"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]", "tools of type 'code_interpreter' (function tools only)"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]", "must be 1 to 64 letters"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "names the function 'get_weather' twice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "'parallel_tool_calls' must be true or false"),
    ({"guided_regex": "(yes|no)"}, "guided_regex", "a regex output constraint cannot be combined with tools"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]}]},
     "messages[1].tool_calls", "arguments as a JSON string"),
]


@pytest.mark.parametrize("extra, param, message", TOOL_ERRORS)
def test_tool_errors_are_400s_that_name_the_problem(smol_server, extra, param, message):
    body = {"model": "smollm2", "messages": ASK, "tools": TOOLS, "max_tokens": 5, **extra}
    r = httpx.post(smol_server.url + "/v1/chat/completions", json={k: v for k, v in body.items() if v is not None},
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and message in err["message"], err
    assert "lark" not in err["message"] and "%json" not in err["message"], err  # the reason, not onecopy's grammar


def test_auto_with_a_json_format_is_a_call_or_that_json(smol_server):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}}, "required": ["answer"],
        "additionalProperties": False}}}
    done = _client(smol_server).chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                                        response_format=fmt, max_tokens=40, temperature=0)
    choice = done.choices[0]
    if choice.message.tool_calls:
        _check_call(choice.message.tool_calls[0])
    else:
        assert isinstance(json.loads(choice.message.content)["answer"], str)


# -- Responses -------------------------------------------------------------------------------------------------

def test_responses_function_calls_and_their_outputs_next_turn(smol_server):
    client = _client(smol_server)
    tools = [_responses_tool(WEATHER)]  # (one: the second turn must fit SmolLM2's 256 positions)
    first = client.responses.create(model="smollm2", input=ASK[0]["content"], tools=tools,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                    temperature=0)
    assert first.status == "completed" and [o.type for o in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    _validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    assert first.tool_choice.name == "get_weather" and [t.name for t in first.tools] == ["get_weather"]
    # the result, on previous_response_id: the previous turn's tokens continue (its call rendered as generated, the
    # same tools shown), so only the new input is prefilled
    second = client.responses.create(model="smollm2", previous_response_id=first.id, tools=tools,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": '{"temperature": 21}'}], max_output_tokens=16, temperature=0)
    assert second.status in ("completed", "incomplete") and second.output
    assert all(o.type in ("message", "function_call") for o in second.output)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["function_call_output"]
    # the same without the store: the call given back in input
    again = client.responses.create(model="smollm2", tools=tools, store=False, input=[
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}],
        max_output_tokens=16, temperature=0)
    assert [o.type for o in again.output] == [o.type for o in second.output]
    assert again.output_text == second.output_text
    r = httpx.post(smol_server.url + "/v1/responses", timeout=60, json={
        "model": "smollm2", "input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]})
    assert r.status_code == 400 and "no function call with call_id 'call_x'" in r.json()["error"]["message"]


def test_responses_stream_function_call_events(smol_server):
    client = _client(smol_server)
    tools = [_responses_tool(t) for t in TOOLS]
    events = list(client.responses.create(model="smollm2", input="What is 17 plus 25?", tools=tools,
                                          tool_choice="required", max_output_tokens=40, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert events[2].item.type == "function_call" and events[2].item.status == "in_progress"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 2 and "".join(deltas) == done.arguments
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    item = events[-2].item
    assert item.type == "function_call" and item.status == "completed" and item.arguments == done.arguments
    _validate(json.loads(item.arguments), SCHEMAS[item.name])
    assert events[-1].response.output[0].call_id == item.call_id
    stored = client.responses.retrieve(events[-1].response.id)
    assert stored.output[0].arguments == item.arguments


# A template that teaches the XML form (Qwen3.5's, Qwen3-Coder's) gets forced calls in it
FLAG = {"type": "object", "properties": {"on": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9},
                                         "note": {"type": "string", "maxLength": 12}},
        "required": ["on", "level"], "additionalProperties": False}
XML_TOOLS = (Tool("get_weather", None, WEATHER["function"]["parameters"]), Tool("set_flag", None, FLAG))
XML_SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "set_flag": FLAG}


def _xml(name: str, *params: tuple[str, str]) -> str:
    return (f"<tool_call>\n<function={name}>\n" + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
            + "</function>\n</tool_call>")


def _accepts(engine, grammar, text: str) -> bool:
    m = engine.grammars.matcher(grammar)._m
    return all(m.consume_token(t) for t in engine.tokenizer.encode(text)) and m.is_accepting()


@pytest.mark.parametrize("text,args", [
    (_xml("get_weather", ("city", "Paris"), ("unit", "celsius")), {"city": "Paris", "unit": "celsius"}),
    (_xml("get_weather", ("city", "San\nJosé <b>"), ("unit", "fahrenheit")), {"city": "San\nJosé <b>",
                                                                               "unit": "fahrenheit"}),
    (_xml("set_flag", ("on", "true"), ("level", "7")), {"on": True, "level": 7}),
    (_xml("set_flag", ("on", "false"), ("level", "0"), ("note", "a\n</b>")), {"on": False, "level": 0,
                                                                              "note": "a\n</b>"}),
    (_xml("get_weather", ("city", "Paris")), None),  # a required argument missing
    (_xml("get_weather", ("city", "Paris"), ("unit", "kelvin")), None),  # not in the enum
    (_xml("get_weather", ("city", "A" * 21), ("unit", "celsius")), None),  # past maxLength
    (_xml("set_flag", ("on", "yes"), ("level", "3")), None),  # not a boolean
    (_xml("set_flag", ("on", "true"), ("level", "12")), None),  # past the maximum
    (_xml("set_flag", ("level", "3"), ("on", "true")), None),  # the schema's order
    ('<tool_call>\n{"name":"set_flag","arguments":{"on":true,"level":3}}\n</tool_call>', None),  # the JSON form
])
def test_a_forced_call_under_an_xml_template_is_that_form_checked_against_the_schema(tiny_engine, text, args):
    """A forced call's grammar where the template teaches the XML form (`<function=NAME>`, a `<parameter=KEY>` block
    per argument in the schema's order, strings raw up to their `</parameter>` with their length bounds, enums,
    numbers and booleans as the schema has them): what it allows parses back to those arguments; what breaks the
    schema (or is the JSON form) it refuses."""
    from onecopy.serve.tools import call_grammar

    grammar = call_grammar(XML_TOOLS, xml=True)
    if args is None:
        assert not _accepts(tiny_engine, grammar, text)
        return
    assert _accepts(tiny_engine, grammar, text)
    (call,) = parse_reply(text, set(XML_SCHEMAS), XML_SCHEMAS).calls
    assert json.loads(call.arguments) == args


def test_sampled_calls_under_an_xml_template_are_valid_calls(smol_engine):
    """SmolLM2 sampling at temperature 1.2 (its template teaches no XML: the mask alone keeps the form): each forced
    call ends, parses as a call of one of the tools, and its arguments are valid against that tool's schema."""
    from onecopy.params import SamplingParams
    from onecopy.serve.tools import call_grammar

    grammar = call_grammar(XML_TOOLS, xml=True)
    for seed in range(4):
        stream = smol_engine.submit(f"Call a tool ({seed}):", SamplingParams(temperature=1.2, seed=seed,
                                                                             max_new_tokens=120, grammar=grammar),
                                    chat=False)
        text = smol_engine.tokenizer.decode(list(stream))
        assert stream.finish_reason == "stop", text
        (call,) = parse_reply(text, set(XML_SCHEMAS), XML_SCHEMAS).calls
        _validate(json.loads(call.arguments), XML_SCHEMAS[call.name])


def test_xml_calls_only_where_the_template_teaches_them_and_each_argument_has_the_form():
    """`teaches_xml_calls` reads the template; a tool with an argument raw text cannot carry as the schema says (a
    string with a pattern) keeps the whole grammar in the JSON form, which the parser reads as well."""
    from onecopy.serve.tools import call_grammar, teaches_xml_calls
    from onecopy.tokenizer import Tokenizer

    tok = Tokenizer.__new__(Tokenizer)
    tok.chat_template = "{% for t in tools %}...<function=example_function_name>...{% endfor %}"
    assert teaches_xml_calls(tok)
    tok.chat_template = '{"name": <function-name>, "arguments": <args-json-object>}'
    assert not teaches_xml_calls(tok)
    assert "<function=set_flag>" in call_grammar(XML_TOOLS, xml=True).text
    assert "<function=" not in call_grammar(XML_TOOLS).text
    coded = Tool("lookup", None, {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}})
    assert "<function=" not in call_grammar((*XML_TOOLS, coded), xml=True).text
