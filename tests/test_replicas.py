"""`onecopy serve --replicas N` on a local Ray cluster: two CPU replicas behind Ray Serve, driven by the
official openai client and httpx. One cluster for the module; the app is redeployed per model."""

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import openai
import pytest
import ray
from ray import serve

import onecopy
from onecopy import EngineConfig
from onecopy.replicas.deployments import REPLICA_HEADER, ReplicaSpec
from onecopy.replicas.launch import APP_NAME, ReplicatedServer, build_application
from onecopy.serve import ServerConfig

from .conftest import wait_until

GREEDY = dict(temperature=0, max_tokens=6)


def _free_port():
    """A free port for Ray Serve's proxy, which binds the port it is given (port 0 would give one nobody can
    read back). Not one the kernel picked for port 0 and released: the kernel hands that range out again to
    any connection or port-0 bind (Ray's own among them) before the proxy binds it. A port below that range
    and above Ray's worker ports (10002-19999), free now, is taken only by a process that names it."""
    try:
        top = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        top = 32768
    low, top = (20000, top) if top > 20100 else (20000, 32768)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(low, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {low}..{top}")


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _health(url):
    return httpx.get(url + "/health", timeout=10).json()


def _live(url):
    return [r for r in _health(url)["replicas"] if r["status"] == "ok"]


def _deploy(server, spec, replicas=2):
    """Replace the running app by ``replicas`` engines of ``spec``; wait until every one reports."""
    serve.run(build_application(spec, replicas, grace_s=5), name=APP_NAME, route_prefix="/")
    server.deployed = spec
    rows = spec.engine.max_sessions or 8
    assert wait_until(lambda: [r["rows_total"] for r in _live(server.url)] == [rows] * replicas, timeout=120)


def _kill(replica_id):
    """Kill a replica's actor, as a crash would (Ray Serve then starts a new one)."""
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(f"#{replica_id}")]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)


@pytest.fixture(scope="module")
def cluster(tiny_bundle):
    spec = ReplicaSpec(str(tiny_bundle), engine=EngineConfig(max_sessions=2, max_queue=2),
                       server=ServerConfig(model_name="tiny"))
    server = ReplicatedServer(spec, 2, port=_free_port(), num_cpus=4, grace_s=5)
    server.start()
    server.spec = server.deployed = spec
    assert wait_until(lambda: len(_live(server.url)) == 2, timeout=60)
    yield server
    server.stop()


@pytest.fixture
def tiny(cluster):
    if cluster.deployed is not cluster.spec:
        _deploy(cluster, cluster.spec)
    return cluster


def test_every_route_answers_through_both_replicas_as_one_server_would(tiny, tiny_bundle):
    with onecopy.Engine.load(tiny_bundle) as engine:
        want = engine.tokenizer.decode(engine.submit([5, 6, 7], onecopy.SamplingParams(max_new_tokens=6),
                                                     stop_ids=[]).result())
    c = _client(tiny.url)
    assert [m.id for m in c.models.list()] == ["tiny"]
    seen = set()
    for _ in range(8):
        raw = c.completions.with_raw_response.create(model="tiny", prompt=[5, 6, 7], extra_body={"ignore_eos": True},
                                                     **GREEDY)
        assert raw.parse().choices[0].text == want
        seen.add(raw.headers[REPLICA_HEADER])
        with httpx.stream("POST", tiny.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": [5, 6, 7], "stream": True, "ignore_eos": True, **GREEDY}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            seen.add(r.headers[REPLICA_HEADER])
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"
    live = {r["replica"] for r in _health(tiny.url)["replicas"]}
    assert seen == live and len(live) == 2  # both replicas served, and every response named its replica
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt=[5, 6, 7], stream=True, extra_body={"ignore_eos": True}, **GREEDY))
    assert streamed == want
    # The single server's errors, unchanged, and the ingress's own (413) in the same shape.
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="other", prompt=[1], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    big = httpx.post(tiny.url + "/v1/completions", content=b"x" * (5 << 20), timeout=60)
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


def test_health_lists_the_replicas_and_metrics_label_them(tiny):
    # A replica frees a finished request's row as its stream winds down, after the client has the last byte.
    assert wait_until(lambda: _health(tiny.url)["rows_free"] == 4, timeout=30)
    health = _health(tiny.url)
    assert health["status"] == "ok" and health["rows_free"] == 4 and len(health["replicas"]) == 2
    for r in health["replicas"]:
        assert (r["status"], r["rows_total"], r["device"]) == ("ok", 2, "cpu") and r["device_memory_used_bytes"] > 0
    text = httpx.get(tiny.url + "/metrics").text
    for r in health["replicas"]:
        for name in ("onecopy_replica_rows_free", "onecopy_replica_sessions_running", "onecopy_replica_requests_waiting",
                     "onecopy_replica_device_memory_used_bytes", "onecopy_replica_up"):
            assert f'{name}{{replica="{r["replica"]}"}}' in text, name
    assert 'onecopy_requests_total{endpoint="completion",status="200"}' in text


def test_a_killed_replica_is_replaced_and_requests_go_on(tiny):
    c = _client(tiny.url)
    before = {r["replica"] for r in _health(tiny.url)["replicas"]}
    victim = sorted(before)[0]
    _kill(victim)
    for _ in range(6):  # answered by the live replica (a request sent to the dead one is routed again)
        raw = c.completions.with_raw_response.create(model="tiny", prompt=[1, 2], max_tokens=2)
        assert raw.headers[REPLICA_HEADER] != victim
    assert wait_until(lambda: (lambda h: len(h["replicas"]) == 2 and h["status"] == "ok"
                               and victim not in {r["replica"] for r in h["replicas"]})(_health(tiny.url)), timeout=120)


# -- SmolLM2: conversations, overload and a replica dying mid-stream ---------------------------------------------

@pytest.fixture
def smol(cluster, smollm2_bundle):
    spec = ReplicaSpec(str(smollm2_bundle), engine=EngineConfig(max_sessions=4, max_queue=0),
                       server=ServerConfig(model_name="smollm2"))
    _deploy(cluster, spec)
    return cluster


@pytest.mark.slow
def test_conversations_stay_with_their_replica_full_rows_give_429_and_a_dead_replica_ends_streams(smol):
    c = _client(smol.url)
    # Six conversations: turn 2 goes where turn 1 went and prefills only what is new.
    convs, where = [], {}
    for i in range(6):
        history = [{"role": "user", "content": f"Name a colour number {i}."}]
        raw = c.chat.completions.with_raw_response.create(model="smollm2", messages=history, **GREEDY)
        r = raw.parse()
        history.append({"role": "assistant", "content": r.choices[0].message.content})
        convs.append((history, raw.headers[REPLICA_HEADER], r.usage.prompt_tokens))
    assert len({rid for _, rid, _ in convs}) == 2  # new conversations spread over both replicas
    for history, rid, first_prompt in convs:
        history.append({"role": "user", "content": "Another one?"})
        raw = c.chat.completions.with_raw_response.create(model="smollm2", messages=history, **GREEDY)
        usage = raw.parse().usage
        assert raw.headers[REPLICA_HEADER] == rid
        # the previous turn's blocks, found in this replica's prefix cache (whole blocks of 16)
        assert first_prompt - 16 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
        where[rid] = history
    # Responses API turns: one on a response id goes to the replica that answered it (its state is there; the other
    # has no such response), and so does a read of it.
    firsts = []
    for i in range(6):
        raw = c.responses.with_raw_response.create(model="smollm2", input=f"Name a fruit number {i}.", temperature=0,
                                                   max_output_tokens=8)
        firsts.append((raw.parse(), raw.headers[REPLICA_HEADER]))
    assert len({rid for _, rid in firsts}) == 2
    for r, rid in firsts:
        raw = c.responses.with_raw_response.create(model="smollm2", input="Another one?", previous_response_id=r.id,
                                                   temperature=0, max_output_tokens=8)
        held = (r.usage.input_tokens + r.usage.output_tokens - 1) // 16 * 16
        assert raw.headers[REPLICA_HEADER] == rid and raw.parse().usage.input_tokens_details.cached_tokens >= held
        read = c.responses.with_raw_response.retrieve(r.id)
        assert read.headers[REPLICA_HEADER] == rid and read.parse().output_text == r.output_text

    # Every row busy (4 per replica, no queue): the next request gets 429 with Retry-After, not a wait.
    streams, stop = [], threading.Event()

    def long_stream():
        with httpx.stream("POST", smol.url + "/v1/completions", timeout=120,
                          json={"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 200, "stream": True,
                                "ignore_eos": True}) as r:
            streams.append(r.status_code)
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=long_stream) for _ in range(8)]
    for t in threads:
        t.start()
    assert wait_until(lambda: _health(smol.url)["running"] == 8, timeout=60), (_health(smol.url), streams)
    with pytest.raises(openai.RateLimitError) as refused:
        c.completions.create(model="smollm2", prompt="hi", max_tokens=2)
    assert refused.value.response.headers["retry-after"] == "1"
    stop.set()
    for t in threads:
        t.join(timeout=60)
    assert streams == [200] * 8
    assert wait_until(lambda: _health(smol.url)["running"] == 0, timeout=60)  # the cut streams freed their rows

    # A replica killed mid-stream: the stream ends with an error event and [DONE], never a hang.
    with httpx.stream("POST", smol.url + "/v1/completions", timeout=60,
                      json={"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 200, "stream": True,
                            "ignore_eos": True}) as r:
        victim = r.headers[REPLICA_HEADER]
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        _kill(victim)
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]" and '"code": "replica_unavailable"' in rest[-2]
    # Its conversation goes on elsewhere: the client sends the whole history, the other replica prefills it
    # (all but the chat template's opening block, which every conversation there shares).
    history = where[victim]
    raw = c.chat.completions.with_raw_response.create(model="smollm2", messages=history, **GREEDY)
    assert raw.headers[REPLICA_HEADER] != victim and raw.parse().usage.prompt_tokens_details.cached_tokens <= 32


@pytest.mark.slow
def test_transcriptions_through_the_replicas(cluster, whisper_bundle, speech_wav):
    spec = ReplicaSpec(str(whisper_bundle), engine=EngineConfig(max_sessions=2), server=ServerConfig(model_name="whisper"))
    _deploy(cluster, spec)
    with open(speech_wav, "rb") as f:
        r = _client(cluster.url).audio.transcriptions.with_raw_response.create(model="whisper", file=f)
    assert "fox" in r.parse().text.lower() and r.headers[REPLICA_HEADER]


# -- the CLI: SIGTERM drains and leaves no Ray process ------------------------------------------------------

def _ray_processes():
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [p for p in out if ("raylet" in p or "gcs_server" in p or p.startswith("ray::")) and "ps -eo" not in p]


def test_cli_serves_replicas_drains_on_sigterm_and_leaves_no_ray_process(cluster, tiny_bundle):
    ray_dir = cluster._ray_dir  # the local cluster's session files: its own temp dir, not /tmp/ray
    assert ray_dir is not None and Path(ray_dir).is_dir()
    cluster.stop()  # the module's cluster goes first: this test starts its own through the CLI
    assert wait_until(lambda: not _ray_processes(), timeout=60), _ray_processes()
    assert not Path(ray_dir).exists()
    before = _ray_dirs()
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "onecopy.cli", "serve", "--bundle", str(tiny_bundle), "--replicas", "2",
                             "--port", str(port), "--max-sessions", "2", "--model-name", "tiny", "--grace", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: proc.poll() is None and _up(url), timeout=180), proc.stdout.read() if proc.poll() else ""
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 40, "stream": True,
                                "ignore_eos": True}) as r:
            proc.send_signal(signal.SIGTERM)  # mid-request: the request still finishes
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and '"finish_reason": "length"' in events[-2]
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_until(lambda: not _ray_processes(), timeout=60), _ray_processes()
    assert _ray_dirs() == before  # the CLI's cluster removed its files too


def _ray_dirs():
    return set(Path(tempfile.gettempdir()).glob("onecopy-ray-*"))


def _up(url):
    try:
        h = httpx.get(url + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    return len([r for r in h.get("replicas", []) if r["status"] == "ok"]) == 2


def test_without_replicas_ray_is_not_imported():
    code = ("import sys, onecopy, onecopy.cli, onecopy.serve; from onecopy.cli import build_parser; "
            "build_parser().parse_args(['serve']); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
