"""The Responses API (`serve.responses`) driven by the official openai client's ``client.responses.*`` over loopback:
a response id names the conversation after its turn, and a turn on it prefills only its new input."""

import httpx
import openai
import pytest

import onecopy
from onecopy.serve import BackgroundServer, ServerConfig

from .conftest import wait_until

QUESTION = "What is the capital of France?"


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, history):
    r = client.chat.completions.create(model="smollm2", messages=history, temperature=0, max_tokens=16)
    return r.choices[0].message.content


@pytest.mark.slow
def test_a_chain_prefills_only_its_new_input_and_answers_as_the_whole_history_would(smol_server):
    """Turn 2 on ``previous_response_id`` starts from turn 1's state: every whole block of turn 1's prompt and reply
    is reused from the prefix cache (the reply's blocks too: its ids as generated, not re-tokenized), and it replies
    exactly as a chat completion of the whole history. Two turns on one response each continue from it (a fork:
    the blocks are shared). Stored responses read back (retrieve, input items); a deleted one is gone for GET and
    for previous_response_id; one created with store=false never was."""
    c = _client(smol_server)
    ask = "Describe Paris in a few sentences."
    r1 = c.responses.create(model="smollm2", input=ask, temperature=0, max_output_tokens=40)
    assert r1.status in ("completed", "incomplete") and r1.previous_response_id is None
    # turn 1's state: its prompt and reply but the last id (sampled, never fed), published in whole 16-id blocks
    held = (r1.usage.input_tokens + r1.usage.output_tokens - 1) // 16 * 16
    assert held > r1.usage.input_tokens, r1.usage  # the reply's blocks are in it
    history = [{"role": "user", "content": ask}, {"role": "assistant", "content": r1.output_text}]
    for follow_up in ("And of Berlin?", "And of Rome?"):  # both on r1: a fork
        r2 = c.responses.create(model="smollm2", input=follow_up, previous_response_id=r1.id, temperature=0,
                                max_output_tokens=16)
        # all of turn 1's whole blocks (the second fork may find the first's blocks of the turn's opening too)
        assert held <= r2.usage.input_tokens_details.cached_tokens < r2.usage.input_tokens, (r1.usage, r2.usage)
        assert r2.output_text == _chat(c, history + [{"role": "user", "content": follow_up}])
        assert r2.previous_response_id == r1.id
    got = c.responses.retrieve(r2.id)
    assert got.output_text == r2.output_text and got.usage.output_tokens == r2.usage.output_tokens
    items = c.responses.input_items.list(r2.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "And of Rome?")]
    c.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r1.id)
    with pytest.raises(openai.BadRequestError) as e:  # as OpenAI's API answers a turn on an unknown id
        c.responses.create(model="smollm2", input="Go on.", previous_response_id=r1.id, max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    gone = c.responses.create(model="smollm2", input=QUESTION, store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(gone.id)


@pytest.mark.slow
def test_the_event_stream_carries_the_reply_and_instructions_hold_for_their_turn(smol_server):
    """``stream=True``: the Responses events in order, the deltas adding up to the stored response's text, which is
    the non-streamed reply to the same input. ``instructions`` shape their own turn (a system message), and a turn
    on that response without them is rendered without it, as OpenAI's API does."""
    c = _client(smol_server)
    plain = c.responses.create(model="smollm2", input=QUESTION, instructions="Answer in one word.", temperature=0,
                               max_output_tokens=12)
    events = list(c.responses.create(model="smollm2", input=QUESTION, instructions="Answer in one word.",
                                     temperature=0, max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{plain.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == plain.output_text
    assert c.responses.retrieve(final.id).output_text == text
    again = c.responses.create(model="smollm2", input="Why?", previous_response_id=final.id, temperature=0,
                               max_output_tokens=12)
    assert again.instructions is None
    stored = next(line for line in httpx.get(smol_server.url + "/metrics").text.splitlines()
                  if line.startswith("onecopy_responses_stored "))
    assert float(stored.split()[1]) == 3
    assert again.output_text == _chat(c, [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": text},
                                          {"role": "user", "content": "Why?"}])


def test_a_reply_cut_by_max_output_tokens_is_an_incomplete_message(smol_server):
    """Streamed or not: the response is incomplete, and so is its message item."""
    c = _client(smol_server)
    whole = c.responses.create(model="smollm2", input=QUESTION, temperature=0, max_output_tokens=3)
    assert whole.status == "incomplete" and [(o.type, o.status) for o in whole.output] == [("message", "incomplete")]
    events = list(c.responses.create(model="smollm2", input=QUESTION, temperature=0, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert [(o.type, o.status) for o in events[-1].response.output] == [("message", "incomplete")]
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"
    assert events[-1].response.output_text == whole.output_text
    assert c.responses.retrieve(whole.id).output[0].status == "incomplete"


@pytest.mark.parametrize("body, status, param", [
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 400, "previous_response_id"),
    ({"input": "hi", "text": "plain"}, 400, "text"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, 400, "input[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input[0]"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({"input": "hi", "instructions": 3}, 400, "instructions"),
    ({"input": "hi", "max_output_tokens": 100000}, 400, "max_output_tokens"),
    ({"input": "hi", "stream": "yes"}, 400, "stream"),
])
def test_bad_responses_requests_get_openai_error_objects(smol_server, body, status, param):
    r = httpx.post(smol_server.url + "/v1/responses", json={"model": "smollm2", **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_unknown_response_ids_are_404s_and_bad_query_parameters_400s(smol_server):
    for method, path in (("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                         ("GET", "/v1/responses/resp_nope/input_items")):
        r = httpx.request(method, smol_server.url + path, timeout=30)
        assert r.status_code == 404 and "resp_nope" in r.json()["error"]["message"], (method, path, r.text)
    r = httpx.get(smol_server.url + "/v1/responses/resp_nope/input_items?limit=many", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text


@pytest.mark.slow
def test_responses_in_a_state_dir_outlive_the_server_and_foreign_or_broken_files_are_not_found(smol_engine, tmp_path):
    """With ``state_dir`` each stored response is a file: a new server on the same directory (a restart: its
    store starts empty) retrieves it and continues it as the whole history would; deleting removes the file. A
    file of another model (its bundle fingerprint), one that does not parse, and ids that are no response id are
    404s, never a crash."""
    config = ServerConfig(model_name="smollm2", state_dir=str(tmp_path))
    with BackgroundServer(smol_engine, config) as first:
        r1 = _client(first).responses.create(model="smollm2", input=QUESTION, temperature=0, max_output_tokens=12)
    files = sorted(p.name for p in (tmp_path / "responses").iterdir())
    assert files == [f"{r1.id}.json"]
    with BackgroundServer(smol_engine, config) as second:
        c = _client(second)
        assert len(second.app.state.onecopy.responses) == 0  # nothing in memory: it comes from the file
        assert c.responses.retrieve(r1.id).output_text == r1.output_text
        r2 = c.responses.create(model="smollm2", input="And of Germany?", previous_response_id=r1.id, temperature=0,
                                max_output_tokens=12)
        assert r2.output_text == _chat(c, [{"role": "user", "content": QUESTION},
                                           {"role": "assistant", "content": r1.output_text},
                                           {"role": "user", "content": "And of Germany?"}])
        record = (tmp_path / "responses" / f"{r2.id}.json").read_text()
        foreign, broken = "resp_" + "a" * 32, "resp_" + "b" * 32
        (tmp_path / "responses" / f"{foreign}.json").write_text(
            record.replace(smol_engine.manifest.fingerprint(), "0" * 64).replace(r2.id, foreign))
        (tmp_path / "responses" / f"{broken}.json").write_text(record[:40])
        for rid in (foreign, broken, "..%2Fresponses%2F" + r2.id, "resp_../" + r2.id):
            r = httpx.get(f"{second.url}/v1/responses/{rid}", timeout=30)
            assert r.status_code == 404, (rid, r.text)
        with pytest.raises(openai.BadRequestError):
            c.responses.create(model="smollm2", input="Go on.", previous_response_id=foreign, max_output_tokens=4)
        c.responses.delete(r2.id)
        assert not (tmp_path / "responses" / f"{r2.id}.json").exists()
    assert wait_until(lambda: smol_engine.sessions_open == 0)


@pytest.mark.slow
def test_a_restarted_server_continues_a_response_from_its_saved_kv_blocks(smollm2_bundle, tmp_path):
    """The engine restarts too (its device cache gone): a disk tier of KV blocks on the state directory (what
    `onecopy serve --state-dir` sets up) keeps the blocks of turn 1's prompt and reply, saved at close, and turn 2
    on previous_response_id loads them instead of prefilling the history: cached tokens reported, the reply
    the same as a chat of the whole history."""
    config = ServerConfig(model_name="smollm2", state_dir=str(tmp_path))
    options = dict(max_sessions=2, kv_disk_dir=str(tmp_path / "kv"))
    with onecopy.Engine.load(smollm2_bundle, **options) as engine, BackgroundServer(engine, config) as first:
        r1 = _client(first).responses.create(model="smollm2", input=QUESTION, temperature=0, max_output_tokens=12)
    assert list((tmp_path / "kv").glob("kv-*/*.kv"))  # saved when the engine closed
    with onecopy.Engine.load(smollm2_bundle, **options) as engine, BackgroundServer(engine, config) as second:
        c = _client(second)
        r2 = c.responses.create(model="smollm2", input="And of Germany?", previous_response_id=r1.id, temperature=0,
                                max_output_tokens=12)
        tiers = engine.scheduler.kv.tiers
        assert tiers.stats.restored_disk >= 1 and tiers.stats.restored_host == 0
        block = engine.manifest.kv_block_size
        assert r2.usage.input_tokens_details.cached_tokens == tiers.stats.restored_disk * block
        assert r2.output_text == _chat(c, [{"role": "user", "content": QUESTION},
                                           {"role": "assistant", "content": r1.output_text},
                                           {"role": "user", "content": "And of Germany?"}])


def _entry(i: int, ids: int = 100):
    from onecopy.serve.responses import StoredResponse

    rid = f"resp_{i:032x}"
    return StoredResponse(rid, {"id": rid}, [], [{"role": "user", "content": "hi"}], None, "hi", list(range(ids)), "yo")


def test_the_store_keeps_a_byte_budget_private_files_and_deletions_across_servers(tmp_path):
    """The memory tier stays under its byte budget (least recently used out, their files kept); files are the
    server user's alone (0600 in a 0700 directory); a response deleted through one server sharing the directory is
    gone for another that still holds it in memory; a file that cannot be written leaves the entry in memory and no
    temporary file behind."""
    import stat

    from onecopy.serve.responses import ResponseStore

    one = _entry(0).nbytes
    a = ResponseStore(directory=tmp_path / "r", fingerprint="f", max_bytes=3 * one)
    b = ResponseStore(directory=tmp_path / "r", fingerprint="f")
    for i in range(5):
        a.put(_entry(i))
    assert len(a) == 3 and a._bytes <= 3 * one
    assert stat.S_IMODE((tmp_path / "r").stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "r").iterdir()} == {0o600}
    assert a.get(_entry(0).id).token_ids.tolist() == list(range(100))  # evicted from memory, read from its file
    assert b.delete(_entry(4).id) and a.get(_entry(4).id) is None
    (tmp_path / "r" / f"{_entry(9).id}.json").mkdir()  # its file's name taken: the write fails (root too)
    a.put(_entry(9))
    assert a.get(_entry(9).id).reply_text == "yo"  # in memory only...
    assert not [p for p in (tmp_path / "r").iterdir() if p.name.startswith(".")]  # ...and no temporary file left



def test_a_thousand_stored_responses_outlive_a_restart(tmp_path):
    """1,000 conversations stored under the default budgets, the memory tier holding some: a store started on the
    same directory (a restarted server) finds every one (their KV blocks: tests/test_kv_tiers.py)."""
    from onecopy.serve.responses import ResponseStore

    first = ResponseStore(directory=tmp_path / "r", fingerprint="f", max_bytes=64 * _entry(0).nbytes)
    for i in range(1000):
        first.put(_entry(i))
    again = ResponseStore(directory=tmp_path / "r", fingerprint="f")
    assert all(again.get(_entry(i).id).token_ids.tolist() == list(range(100)) for i in range(1000))


def test_the_state_directory_keeps_a_byte_budget_of_files(tmp_path):
    """Response files past ``max_file_bytes`` go, least recently written first, and their responses with them (a
    404, in memory too); a server started on the directory counts the files already there."""
    from onecopy.serve.responses import ResponseStore

    a = ResponseStore(directory=tmp_path / "r", fingerprint="f")
    a.put(_entry(0))
    size = (tmp_path / "r" / f"{_entry(0).id}.json").stat().st_size
    small = ResponseStore(directory=tmp_path / "r", fingerprint="f", max_file_bytes=3 * size)
    assert small._file_bytes == size  # found at start
    for i in range(1, 5):
        small.put(_entry(i))
    kept = sorted(p.name for p in (tmp_path / "r").iterdir())
    assert kept == sorted(f"{_entry(i).id}.json" for i in (2, 3, 4)) and small._file_bytes == 3 * size
    assert small.get(_entry(1).id) is None and small.get(_entry(0).id) is None  # gone from memory too
    assert small.get(_entry(4).id).reply_text == "yo"
    assert small.delete(_entry(4).id) and small._file_bytes == 2 * size
