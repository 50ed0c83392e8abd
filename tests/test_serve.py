"""`onecopy serve`: the OpenAI-compatible server, driven by the official openai client over loopback."""

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import onecopy
from onecopy.serve import BackgroundServer, ServerConfig

from .conftest import wait_until as _wait_until

QUESTION = "What is the capital of France?"


def _client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, timeout=120, **kw)


@pytest.fixture
def tiny_server(tiny_bundle):
    with onecopy.Engine.load(tiny_bundle, max_sessions=2, max_queue=2) as engine, \
            BackgroundServer(engine, ServerConfig(model_name="tiny")) as server:
        server.engine = engine
        yield server


def test_models_health_and_metrics(tiny_server):
    c = _client(tiny_server)
    assert [m.id for m in c.models.list()] == ["tiny"]
    health = httpx.get(tiny_server.url + "/health").json()
    assert health == {"status": "ok", "rows_free": 2, "running": 0, "waiting": 0}
    c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0)
    text = httpx.get(tiny_server.url + "/metrics").text
    for name in ("onecopy_requests_total{endpoint=\"completion\",status=\"200\"} 1.0", "onecopy_prompt_tokens_total 3.0",
                 "onecopy_generation_tokens_total 4.0", "onecopy_time_to_first_token_seconds_count 1.0",
                 "onecopy_inter_token_latency_seconds_count 3.0", "onecopy_sessions_running 0.0",
                 "onecopy_requests_waiting 0.0", "onecopy_rows_free 2.0", "onecopy_device_memory_used_bytes"):
        assert name in text, name


@pytest.mark.slow
def test_chat_sync_and_streaming_equal_onecopy_run(smol_server):
    engine = smol_server.engine
    with engine.open_session() as s:  # what `onecopy run` does
        want_ids = [t.id for t in s.generate(QUESTION, onecopy.SamplingParams())]
    want = engine.tokenizer.decode(want_ids)
    assert want == "The capital of France is Paris."
    c = _client(smol_server)
    r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}], temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    prompt = engine.encode_prompt(QUESTION)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(want_ids))
    assert r.usage.total_tokens == len(prompt) + len(want_ids)
    chunks = list(c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want_ids)


@pytest.mark.slow
def test_stop_strings_and_max_tokens(smol_server):
    c = _client(smol_server)
    msgs = [{"role": "user", "content": QUESTION}]
    r = c.chat.completions.create(model="smollm2", messages=msgs, temperature=0, stop=[" is", "zzz"])
    assert r.choices[0].message.content == "The capital of France" and r.choices[0].finish_reason == "stop"
    parts = [ch.choices[0].delta.content or "" for ch in
             c.chat.completions.create(model="smollm2", messages=msgs, temperature=0, stop="Paris", stream=True)]
    assert "".join(parts) == "The capital of France is "
    r = c.chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].message.content == "The capital of"


def test_async_client_streams_concurrently(tiny_bundle):
    """Three streams at once through the async client equal their solo runs: a deterministic engine, so the
    batched steps cannot flip a near-tie that a solo run decides the other way."""
    prompts = [[4, 5, 6], [7, 8], [9, 10, 11]]
    with onecopy.Engine.load(tiny_bundle, max_sessions=3, deterministic=True) as engine, \
            BackgroundServer(engine, ServerConfig(model_name="tiny")) as server:
        want = [engine.submit(p, onecopy.SamplingParams(max_new_tokens=10), stop_ids=[]).result() for p in prompts]

        async def one(client, prompt):
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            return "".join([ch.choices[0].text async for ch in stream])

        async def main():
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            async with client:
                return await asyncio.gather(*(one(client, p) for p in prompts))

        texts = asyncio.run(main())
        assert texts == [engine.tokenizer.decode(w) for w in want]


def test_completions_take_text_or_token_ids(tiny_server):
    engine = tiny_server.engine
    c = _client(tiny_server)
    ids = engine.submit([5, 6, 7], onecopy.SamplingParams(max_new_tokens=6), stop_ids=[]).result()
    r = c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0)
    assert r.choices[0].text == engine.tokenizer.decode(ids) and r.usage.prompt_tokens == 3
    r = c.completions.create(model="tiny", prompt="hi", max_tokens=6, temperature=0, seed=3)
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode("hi")) and r.usage.completion_tokens == 6


def test_clients_beyond_capacity_complete_or_get_429(tiny_server):
    """2 rows and a queue of 2: of 12 simultaneous clients each completes or gets 429; none hangs."""
    engine = tiny_server.engine
    real = engine.runner.decode

    def slow(*a, **k):  # slow steps so that the requests really overlap
        time.sleep(0.03)
        return real(*a, **k)

    engine.runner.decode = slow
    results = []
    clients = [_client(tiny_server) for _ in range(12)]
    start = threading.Barrier(12)  # all twelve ask at once, even on a slow 2-core CI machine

    def client(i):
        try:
            start.wait()
            stream = clients[i].completions.create(model="tiny", prompt=[i + 1, 2], max_tokens=20,
                                                   temperature=0, stream=True)
            results.append(("ok", sum(1 for _ in stream)))
        except openai.RateLimitError as e:
            results.append(("429", e.response.headers.get("retry-after"), e.body["code"]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    ok = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == "429"]
    assert len(results) == 12 and len(ok) >= 2 and refused
    assert all(r[1:] == ("1", "rate_limit_exceeded") for r in refused)
    assert _wait_until(lambda: engine.capacity() == 2 and engine.scheduler.running == 0 and engine.scheduler.waiting == 0)
    metrics = httpx.get(tiny_server.url + "/metrics").text
    assert f'onecopy_requests_total{{endpoint="completion",status="429"}} {float(len(refused))}' in metrics


def test_a_client_that_disconnects_frees_its_row(tiny_server):
    engine = tiny_server.engine
    real = engine.runner.decode
    steps = []
    engine.runner.decode = lambda *a, **k: (steps.append(1), time.sleep(0.02), real(*a, **k))[2]
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 60, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", tiny_server.url + "/v1/completions", json=body) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data:")
            if events == 3:
                assert engine.capacity() == 1
                break
    assert _wait_until(lambda: engine.capacity() == 2 and engine.scheduler.running == 0, timeout=30)
    # Freed at once, not after the 60 tokens: counted in decode steps, which a loaded machine slows down too.
    assert len(steps) < 45, len(steps)
    assert engine.scheduler.stats.requests_finished["cancelled"] == 1


def test_api_key_is_enforced(tiny_bundle):
    with onecopy.Engine.load(tiny_bundle, max_sessions=2) as engine, \
            BackgroundServer(engine, ServerConfig(model_name="tiny", api_key="s3cret")) as server:
        with pytest.raises(openai.AuthenticationError) as e:
            _client(server, api_key="wrong").models.list()
        assert e.value.body["code"] == "invalid_api_key" and "Incorrect API key" in e.value.body["message"]
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["message"].startswith("No API key provided")
        assert [m.id for m in _client(server, api_key="s3cret").models.list()] == ["tiny"]
        assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


BAD = [
    ("malformed json", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, "invalid_request_error", None, "invalid_json"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, "invalid_request_error", None, "invalid_json"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "invalid_request_error", "model",
     "model_not_found"),
    ("missing model", "/v1/completions", {"prompt": "x"}, 400, "invalid_request_error", "model",
     "missing_required_parameter"),
    ("n > 1", "/v1/completions", {"model": "tiny", "prompt": "x", "n": 2}, 400, "invalid_request_error", "n",
     "unsupported_parameter"),
    ("tools in completions", "/v1/completions", {"model": "tiny", "prompt": "x",
                                                 "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "invalid_request_error", "tools", "unsupported_parameter"),
    ("legacy functions", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                  "functions": [{"name": "f"}]},
     400, "invalid_request_error", "functions", "unsupported_parameter"),
    ("logprobs", "/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 2}, 400, "invalid_request_error",
     "logprobs", "unsupported_parameter"),
    ("temperature", "/v1/completions", {"model": "tiny", "prompt": "x", "temperature": 5}, 400,
     "invalid_request_error", "temperature", "invalid_value"),
    ("max_tokens 0", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400,
     "invalid_request_error", "max_tokens", "invalid_value"),
    ("past max_seq_len", "/v1/completions", {"model": "tiny", "prompt": [1] * 60, "max_tokens": 10}, 400,
     "invalid_request_error", "max_tokens", "context_length_exceeded"),
    ("token out of vocabulary", "/v1/completions", {"model": "tiny", "prompt": [1, 512]}, 400,
     "invalid_request_error", "prompt", "invalid_value"),
    ("stream_options without stream", "/v1/completions", {"model": "tiny", "prompt": "x",
                                                          "stream_options": {"include_usage": True}},
     400, "invalid_request_error", "stream_options", "invalid_value"),
    ("no chat template", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]},
     400, "invalid_request_error", "messages", None),
    ("bad message", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]},
     400, "invalid_request_error", "messages[0]", "invalid_value"),
    ("body too large", "/v1/completions", {"model": "tiny", "prompt": "x" * (5 << 20)}, 413, "invalid_request_error",
     None, "request_too_large"),
    ("speech on a text model", "/v1/audio/transcriptions", {"model": "tiny"}, 404, "invalid_request_error", None,
     "model_not_found"),
    ("unknown route", "/v1/embeddings", {"model": "tiny"}, 404, "invalid_request_error", None, "not_found"),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_error_objects(tiny_server, case):
    _, path, body, status, etype, param, code = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(tiny_server.url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["type"], err["param"], err["code"]) == (etype, param, code), err


@pytest.mark.slow
def test_conversation_reuse_gives_the_same_replies(smol_engine, smollm2_bundle):
    """A 3-turn chat starts each turn on the KV blocks its previous turn left in the prefix cache (only
    what is new is prefilled; one mechanism: the conversation cache is the prefix cache's special case)
    and replies exactly as a server without the cache, which prefills the whole history every turn."""
    turns = ["What is the capital of France?", "And of Germany?", "Which of the two is larger?"]

    def chat(engine, **config):
        with BackgroundServer(engine, ServerConfig(model_name="smollm2", **config)) as server:
            assert server.app.state.onecopy.cache is None  # no kept sessions: the blocks stay published
            c, history, replies = _client(server), [], []
            for i, t in enumerate(turns):
                history.append({"role": "user", "content": t})
                r = c.chat.completions.create(model="smollm2", messages=history, temperature=0, max_tokens=24)
                replies.append(r.choices[0].message.content)
                cached = r.usage.prompt_tokens_details.cached_tokens
                if not engine.prefix_cache:
                    assert cached == 0
                elif i == 0:  # the chat template's opening (its system prompt), shared with earlier chats
                    assert cached in (0, 16, 32)
                else:  # all but the last partial block of the history so far
                    assert r.usage.prompt_tokens - 40 < cached < r.usage.prompt_tokens and cached % 16 == 0
                history.append({"role": "assistant", "content": replies[-1]})
            metrics = httpx.get(server.url + "/metrics").text
        return replies, metrics

    reused, metrics = chat(smol_engine)
    with onecopy.Engine.load(smollm2_bundle, max_sessions=4, prefix_cache=False) as plain:
        fresh, _ = chat(plain, conversation_cache=False)
    assert reused == fresh
    saved = float(next(line.split()[1] for line in metrics.splitlines()
                       if line.startswith("onecopy_prefix_reused_tokens_total")))
    assert saved > 50
    assert _wait_until(lambda: smol_engine.sessions_open == 0)


def test_serve_cli_drains_on_sigterm(tiny_bundle):
    """A process of its own (SIGTERM goes to the process). --port 0: the OS picks a free port, which onecopy's line
    names once it is bound (no port picked by us and released before the server binds it: a race)."""
    proc = subprocess.Popen([sys.executable, "-m", "onecopy.cli", "serve", "--bundle", str(tiny_bundle), "--port", "0",
                             "--grace", "5", "--model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)  # until the process ends
    reader.start()

    def bound_url():  # onecopy names the URL once the socket is bound: the port the OS picked, never 0
        found = [m for line in list(lines) if (m := re.search(r"onecopy: serving tiny on (http://\S+:(\d+))/v1", line))]
        return found[0].group(1) if found and found[0].group(2) != "0" else None

    try:
        assert _wait_until(lambda: bound_url() or proc.poll() is not None, timeout=120) and bound_url(), "".join(lines)
        url = bound_url()
        assert _wait_until(lambda: _up(url), timeout=30)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        stream = client.completions.create(model="tiny", prompt=[1, 2], max_tokens=40, temperature=0, stream=True)
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)  # the running stream finishes within the grace period
        assert first.choices[0].text is not None and rest and rest[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=30) == 0
        assert not _up(url)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _up(url):
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_transcription_endpoint(whisper_bundle, speech_wav, tmp_path):
    with onecopy.Engine.load(whisper_bundle) as engine, \
            BackgroundServer(engine, ServerConfig(model_name="whisper")) as server:
        c = _client(server)
        with open(speech_wav, "rb") as f:
            r = c.audio.transcriptions.create(model="whisper", file=f)
        assert "lazy dog" in r.text.lower()
        with open(speech_wav, "rb") as f:
            text = c.audio.transcriptions.create(model="whisper", file=f, response_format="text")
        assert "lazy dog" in str(text).lower()
        bad = tmp_path / "notes.wav"
        bad.write_text("not audio")
        with open(bad, "rb") as f, pytest.raises(openai.BadRequestError) as e:
            c.audio.transcriptions.create(model="whisper", file=f)
        assert e.value.body["param"] == "file" and e.value.body["message"].startswith("notes.wav is not a WAV file")
        with pytest.raises(openai.BadRequestError, match="speech model"):
            c.chat.completions.create(model="whisper", messages=[{"role": "user", "content": "hi"}])
        assert engine.sessions_open == 0


def test_a_client_gone_before_the_first_byte_still_cancels_its_request(tiny_bundle):
    """A client that disconnects before a stream's first byte (at once, with a transport that yields on every write:
    the response is cancelled around its start): its request is cancelled, its row freed and it is counted as a 499,
    not left generating to its last token for nobody (a review suspected a leak here; this holds it)."""
    import asyncio

    from onecopy.serve.app import create_app
    from onecopy.serve.asgi import HTTPRequest

    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 48, "stream": True,
                       "ignore_eos": True}).encode()
    with onecopy.Engine.load(tiny_bundle, max_sessions=2) as engine:
        slow = engine.runner.execute

        def paced(*a, **k):  # steps slower than the test's checks: a request left running is still running
            time.sleep(0.05)
            return slow(*a, **k)

        engine.runner.execute = paced
        app = create_app(engine, ServerConfig(model_name="tiny"))

        async def gone_at_once():
            asked = False

            async def receive():
                nonlocal asked
                if not asked:
                    asked = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return {"type": "http.disconnect"}  # at once: before the response's body task starts

            sent = []

            async def send(message):  # a transport that yields on every write (backpressure)
                sent.append(message)
                await asyncio.sleep(0)

            await app(HTTPRequest("POST", "/v1/completions", headers=[(b"content-type", b"application/json")],
                                  body=body).scope(), receive, send)
            return sent

        sent = asyncio.run(gone_at_once())
        assert not any(m.get("body") for m in sent)  # nothing streamed
        assert _wait_until(lambda: engine.scheduler.running == 0 and engine.free_rows == 2, timeout=2)
        metrics = app.state.onecopy.metrics.requests.labels("completion", "499")._value.get()
        assert metrics == 1
