"""Structured outputs: a request's tokens held to a JSON schema, any JSON object, a regex or a Lark grammar
(`onecopy.grammar`, llguidance token masks applied in the on-device sampler), through the engine and through
the server with the official openai client (`chat.completions.parse`, `responses.parse`)."""

import json
import re
from typing import Literal

import httpx
import openai
import pydantic
import pytest

import onecopy
from onecopy.grammar import Grammar, GrammarError
from onecopy.params import SamplingParams

from .conftest import PREEMPTING_PROMPTS, run_preempting

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "color": {"enum": ["red", "green", "blue"]},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                                                    "maxItems": 3}},
          "required": ["name", "age", "color", "tags"], "additionalProperties": False}


# for the tiny model (64 positions, a 512-token vocabulary: a character can take a token)
SMALL = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
                                          "tag": {"type": "string", "maxLength": 4}},
         "required": ["id", "ok", "color", "tag"], "additionalProperties": False}


def _check_small(obj: dict) -> None:
    assert list(obj) == ["id", "ok", "color", "tag"]  # the schema's order
    assert isinstance(obj["id"], int) and 0 <= obj["id"] <= 99 and isinstance(obj["ok"], bool)
    assert obj["color"] in ("red", "green") and isinstance(obj["tag"], str) and len(obj["tag"]) <= 4


def _check_person(obj: dict, tag_len: int = 5) -> None:
    assert list(obj) == ["name", "age", "color", "tags"]  # the schema's order
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
    assert obj["color"] in ("red", "green", "blue")
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and all(len(t) <= tag_len for t in obj["tags"])


def _text(engine, prompt, params):
    stream = engine.submit(prompt, params, chat=False)
    return engine.tokenizer.decode(list(stream)), stream.finish_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_weights_still_write_only_what_the_schema_allows(tiny_engine, temperature):
    # tiny-llama's weights are random: every valid token is the mask's doing
    for seed in range(3):
        params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=56, grammar=Grammar.json_schema(SMALL))
        text, reason = _text(tiny_engine, f"p{seed}", params)
        assert reason == "stop", text
        _check_small(json.loads(text))


def test_regex_lark_and_any_json_object(tiny_engine):
    text, reason = _text(tiny_engine, "mail", SamplingParams(max_new_tokens=40,
                                                             grammar=Grammar.regex(r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)")))
    assert reason == "stop" and re.fullmatch(r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", text), text
    text, reason = _text(tiny_engine, "yes?", SamplingParams(temperature=1.0, seed=1, max_new_tokens=10,
                                                             grammar=Grammar.lark('start: "yes" | "no" | "maybe"')))
    assert reason == "stop" and text in ("yes", "no", "maybe"), text
    params = SamplingParams(temperature=1.0, seed=2, max_new_tokens=56, grammar=Grammar.json_object())
    text, reason = _text(tiny_engine, "obj", params)
    if reason == "stop":  # a random model may not close its object in 56 tokens: then it ran out
        assert isinstance(json.loads(text), dict), text
    else:
        assert reason == "length" and text.startswith("{"), text


def test_constrained_and_free_rows_share_steps_without_bleed(tiny_bundle):
    # a free request's tokens are those of its solo run while a constrained one decodes beside it, and the other way;
    # with overlapped steps too (as on CUDA: a grammar takes a step's ids only when the next step's masks are made)
    free = SamplingParams(temperature=1.0, seed=5, max_new_tokens=24)
    bound = SamplingParams(temperature=1.0, seed=6, max_new_tokens=56, grammar=Grammar.json_schema(SMALL))
    with onecopy.Engine.load(tiny_bundle, device="cpu", max_sessions=4, deterministic=True) as engine:
        solo_free = list(engine.submit("free", free, chat=False))
        solo_bound = list(engine.submit("bound", bound, chat=False))
        for overlap in (False, True):
            engine.loop.overlap = overlap
            with engine.lock:  # both queued before the first step: they share every step
                a, b = engine.submit("free", free, chat=False), engine.submit("bound", bound, chat=False)
            assert (list(a), list(b)) == (solo_free, solo_bound), overlap
    _check_small(json.loads(engine.tokenizer.decode(solo_bound)))


def test_bad_grammars_are_refused_before_queuing(tiny_engine):
    with pytest.raises(GrammarError, match="(?s)json_schema cannot be compiled: .*strin"):
        tiny_engine.submit("x", SamplingParams(grammar=Grammar.json_schema({"type": "strin"})), chat=False)
    with pytest.raises(GrammarError, match="(?s)regex cannot be compiled: .*unclosed character class"):
        tiny_engine.submit("x", SamplingParams(grammar=Grammar.regex("[a-")), chat=False)
    with pytest.raises(GrammarError, match="grammar kind must be one of"):
        Grammar("xml", "<a/>")
    assert tiny_engine.sessions_open == 0


def test_a_grammar_compiles_once_per_schema(tiny_engine):
    g = Grammar.json_schema(PERSON)
    first = tiny_engine.grammars.compile(g)
    assert tiny_engine.grammars.compile(Grammar.json_schema(dict(PERSON))) is first  # cached by content
    assert Grammar.json_schema({"b": 1, "a": 2}).key != Grammar.json_schema({"a": 2, "b": 1}).key  # order matters


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)
    color: Literal["red", "green", "blue"]
    tags: list[str] = pydantic.Field(max_length=3)  # (its items unbounded: the client's schema has no maxLength)


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_parse_gives_schema_valid_objects(smol_server):
    client = _client(smol_server)
    for content in ("Invent a person who likes the sea.", "Describe Marie Curie as a person record."):
        done = client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": content}],
                                             response_format=Person, max_tokens=120, temperature=0)
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)
        _check_person(json.loads(choice.message.content), tag_len=10**6)  # (the model's tags have no length bound)
    resp = client.responses.parse(model="smollm2", input="Invent a person who paints.", text_format=Person,
                                  max_output_tokens=120, temperature=0)
    assert isinstance(resp.output_parsed, Person), resp.output_text
    assert resp.text.format.type == "json_schema"
    obj = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "A JSON object about Paris."}],
                                         response_format={"type": "json_object"}, max_tokens=150, temperature=0)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    # a stream that ends mid-structure says so
    chunks = list(client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "A person."}],
                                                 response_format={"type": "json_schema", "json_schema": {
                                                     "name": "p", "schema": PERSON, "strict": True}},
                                                 max_tokens=5, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length" and text.startswith('{"name":'), text
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": "A person."}],
                                      response_format=Person, max_tokens=5)


def test_extension_constraints_and_errors_over_http(smol_server):
    url = smol_server.url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "Is Paris in France?"}]

    def post(**extra):
        return httpx.post(url, json={"model": "smollm2", "messages": msgs, "max_tokens": 20, **extra}, timeout=120)

    r = post(guided_regex="(yes|no)")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.text
    r = post(guided_grammar='start: "Oui" | "Non"')
    assert r.json()["choices"][0]["message"]["content"] in ("Oui", "Non"), r.text
    r = post(guided_json=json.dumps({"type": "object", "properties": {"answer": {"type": "boolean"}},
                                     "required": ["answer"], "additionalProperties": False}))
    assert json.loads(r.json()["choices"][0]["message"]["content"])["answer"] in (True, False), r.text
    for extra, param, message in [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format", "json_schema cannot be compiled: Invalid type: strin"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
         "'response_format.json_schema.schema' is required"),
        ({"response_format": {"type": "yaml"}}, "response_format", "must be text, json_object or json_schema"),
        ({"response_format": "json"}, "response_format", "'response_format' must be an object"),
        ({"guided_regex": "[a-"}, "guided_regex", "regex cannot be compiled"),
        ({"guided_regex": "a", "guided_grammar": 'start: "a"'}, "guided_grammar", "only one output constraint"),
    ]:
        r = post(**extra)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, "invalid_value"), err
        assert message in err["message"], err


def test_preempted_constrained_requests_resume_their_grammar(tiny_bundle):
    """Six constrained requests on 10 KV blocks (tests/test_preemption.py's load): the newest are preempted and
    resumed by recompute; each resumed grammar replays the ids its request already has, so every output matches
    its regex and, in deterministic mode, equals its solo run."""
    pattern = r"[a-z]{16}-[0-9]{10}"  # long enough that each request still grows to 4 KV blocks
    params = [SamplingParams(max_new_tokens=30, temperature=0.8, top_k=40, seed=i, grammar=Grammar.regex(pattern))
              for i in range(6)]
    runs = run_preempting(tiny_bundle, params, deterministic=True, overlap=True)  # resumed with a step in flight
    assert runs.preemptions >= 3 and runs.references == 0
    eos = runs.eos_ids
    for prompt, q, ids in zip(PREEMPTING_PROMPTS, params, runs.ids):
        text_ids = ids[:ids.index(eos[0])] if eos[0] in ids else ids
        # once complete, one end-of-sequence id ends the request (its stop_ids=[] notwithstanding)
        assert ids[len(text_ids):] == [eos[0]], ids
        with onecopy.Engine.load(tiny_bundle, max_sessions=1, deterministic=True) as solo:
            assert re.fullmatch(pattern, solo.tokenizer.decode(text_ids)), text_ids
            assert list(solo.submit(prompt, q, chat=False, stop_ids=[]).result()) == ids


# The issue's suite: nested objects, arrays, enums, anyOf, required and optional keys, string patterns, numbers with
# bounds (short enough for the tiny model's 64 positions)
SUITE = {
    "nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False},
    "array_of_enums": {"type": "array", "items": {"enum": ["x", "yz", 7, None]}, "minItems": 1, "maxItems": 3},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 99},
                                                                  {"type": "string", "maxLength": 2},
                                                                  {"type": "boolean"}]}},
               "required": ["v"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-c]{2}-[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False},
    "bounds": {"type": "object", "properties": {
        "n": {"type": "integer", "exclusiveMinimum": -3, "maximum": 3},
        "x": {"type": "number", "minimum": -1.5, "maximum": 2.5}}, "required": ["n", "x"],
        "additionalProperties": False},
    "optional": {"type": "object", "properties": {"k": {"type": "boolean"}, "o": {"const": "yes"}},
                 "required": ["k"], "additionalProperties": False},
}


@pytest.mark.parametrize("name", sorted(SUITE))
def test_a_schema_suite_holds_on_random_weights(tiny_engine, name):
    # random weights at temperature 1 pick freely among what the mask allows: every finished output is valid
    import jsonschema

    schema, done = SUITE[name], 0
    for seed in range(4):
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=40, grammar=Grammar.json_schema(schema))
        text, reason = _text(tiny_engine, "x", params)
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            done += 1
        else:
            assert reason == "length", reason
    assert done >= 2, name  # (most draws end inside 40 tokens: a test that validates nothing would prove nothing)


def test_the_schema_suite_through_the_openai_client(smol_server):
    import jsonschema

    client = _client(smol_server)
    cut = []
    for name, schema in SUITE.items():
        done = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": f"Give a JSON value ({name})."}],
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
            max_tokens=60, temperature=0)
        choice = done.choices[0]
        if choice.finish_reason == "length":  # (SmolLM2 may write a number's digits on: "x":1.0000...)
            cut.append(name)
            continue
        assert choice.finish_reason == "stop", (name, choice.finish_reason)
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert len(cut) <= 1, cut
