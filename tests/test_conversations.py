"""The conversation cache end to end (bundles without a prefix cache keep a finished chat's session, so
its next turn prefills only what is new): reuse, reclaim when a new request needs the row, expiry,
through the server and the official openai client."""

from __future__ import annotations

import httpx
import openai

import onecopy
from onecopy.serve import BackgroundServer, ServerConfig

from .conftest import wait_until

REPLY = dict(model="smollm2", temperature=0, max_tokens=6)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _turn(c: openai.OpenAI, history: list[dict], question: str):
    """One chat turn; the history grows by the question and the reply."""
    history.append({"role": "user", "content": question})
    r = c.chat.completions.create(messages=history, **REPLY)
    history.append({"role": "assistant", "content": r.choices[0].message.content})
    return r


def _cached_metric(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("onecopy_conversations_cached")))


def test_a_kept_conversation_is_reused_then_reclaimed_for_a_new_request(smollm2_bundle):
    with onecopy.Engine.load(smollm2_bundle, max_sessions=2, prefix_cache=False) as engine, \
            BackgroundServer(engine, ServerConfig(model_name="smollm2")) as server:
        assert server.app.state.onecopy.cache is not None  # no prefix cache: finished chats keep their sessions
        c = _client(server)
        first, second = [], []
        r = _turn(c, first, "What is the capital of France?")
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert wait_until(lambda: engine.sessions_open == 1)  # kept, idle, holding its row
        r = _turn(c, first, "And of Germany?")
        held = r.usage.prompt_tokens_details.cached_tokens  # the first turn's prompt and reply, not prefilled again
        assert 0 < held < r.usage.prompt_tokens
        _turn(c, second, "Name a colour.")
        assert wait_until(lambda: engine.sessions_open == 2 and engine.capacity() == 0) and _cached_metric(server) == 2
        # Both rows hold idle conversations: a new chat reclaims the least recently used one (the first).
        r = _turn(c, [], "Say hello.")
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens_details.cached_tokens == 0
        assert wait_until(lambda: engine.sessions_open == 2)
        assert _turn(c, second, "Another one?").usage.prompt_tokens_details.cached_tokens > 0  # still kept
        assert _turn(c, first, "Which is larger?").usage.prompt_tokens_details.cached_tokens == 0  # was reclaimed
    assert engine.sessions_open == 0  # the server closed every conversation


def test_an_idle_conversation_expires_and_its_next_turn_starts_over(smollm2_bundle):
    with onecopy.Engine.load(smollm2_bundle, max_sessions=2, prefix_cache=False) as engine, \
            BackgroundServer(engine, ServerConfig(model_name="smollm2", conversation_ttl_s=0.5)) as server:
        c, history = _client(server), []
        _turn(c, history, "What is the capital of France?")
        assert wait_until(lambda: engine.sessions_open == 1)
        assert wait_until(lambda: engine.sessions_open == 0, timeout=30)  # closed by the expiry sweep
        assert _cached_metric(server) == 0 and engine.capacity() == 2
        assert _turn(c, history, "And of Germany?").usage.prompt_tokens_details.cached_tokens == 0
