"""The prefix cache: sessions share the KV blocks of a common prompt, copy on write, LRU eviction.

The tiny bundle is paged (16 positions per block, max_seq_len 64: 5 blocks per session).
"""

from __future__ import annotations

import pytest
import torch

import onecopy
from onecopy.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0)
PROMPT = list(range(3, 43))  # 40 tokens: two full blocks and a partial one


def _blocks(engine):
    """The engine's KV cache manager: which rows hold which blocks (host bookkeeping)."""
    return engine.scheduler.kv


def _state(session) -> dict[str, torch.Tensor]:
    """A session's KV at the positions it holds."""
    return {k: v[:, :session.position].clone() for k, v in session.state.items()}


@pytest.fixture
def uncached(tiny_bundle):
    with onecopy.Engine.load(tiny_bundle, prefix_cache=False) as engine:
        yield engine


def test_bundle_is_paged_and_the_cache_is_on_by_default(tiny_engine):
    m = tiny_engine.manifest
    assert m.kv_block_size == 16 and m.paged_state == list(m.state) and m.table_width == 5
    assert all(spec.paged for spec in m.methods.values())
    r = tiny_engine.memory_report()
    assert r.prefix_cache and r.kv_block_size == 16 and r.kv_blocks == 8 * 5
    assert "prefix cache: on" in str(r)


def test_a_cached_prefix_gives_the_tokens_and_state_of_prefilling_it(tiny_engine, uncached):
    first = tiny_engine.submit(PROMPT, GREEDY)
    assert first.result() and first.cached_tokens == 0
    second = PROMPT + [50, 51, 52]
    cached = tiny_engine.submit(second, GREEDY, keep_session=True)
    plain = uncached.submit(second, GREEDY, keep_session=True)
    assert cached.result() == plain.result()
    assert cached.cached_tokens == 32 and plain.cached_tokens == 0  # two full blocks found
    a, b = _state(cached.session), _state(plain.session)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5, msg=k)
    assert tiny_engine.scheduler.stats.cached_tokens == 32
    cached.session.close()
    plain.session.close()


def test_copy_on_write_when_the_whole_prompt_is_cached(tiny_engine, uncached):
    prompt = PROMPT[:32]  # exactly two blocks: the last token is prefilled again, inside a shared block
    holder = tiny_engine.submit(prompt, GREEDY, keep_session=True)
    holder.result()
    h = holder.session
    shared = list(_blocks(tiny_engine).owned[h.row][:2])
    before = _state(h)
    copies = _blocks(tiny_engine).copies
    other = tiny_engine.submit(prompt, GREEDY, keep_session=True)
    assert other.result() == holder.result() == uncached.submit(prompt, GREEDY).result()
    assert other.cached_tokens == 31
    mine = _blocks(tiny_engine).owned[other.session.row]
    assert mine[0] == shared[0] and mine[1] != shared[1]  # the block it wrote is its own copy
    assert _blocks(tiny_engine).copies == copies + 1
    after = _state(h)
    for k in before:
        assert torch.equal(before[k], after[k]), k  # the holder's bits are untouched
    h.close()
    other.session.close()


def test_sessions_diverging_after_a_shared_prompt_equal_their_solo_runs(tiny_engine, uncached):
    canary = tiny_engine.submit(PROMPT, GREEDY, keep_session=True)
    canary.result()
    c = canary.session
    before = _state(c)
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=s) for s in (1, 2, 3)]
    streams = [tiny_engine.submit(PROMPT, p) for p in params]  # decoded in one batch, on shared blocks
    got = [s.result() for s in streams]
    assert all(s.cached_tokens == 32 for s in streams)
    assert got == [uncached.submit(PROMPT, p).result() for p in params]
    assert len({tuple(g) for g in got}) > 1  # they did diverge
    after = _state(c)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    c.close()


def test_refcounts_return_to_zero_and_shared_bytes_are_reported(tiny_engine):
    streams = [tiny_engine.submit(PROMPT + [60 + i], GREEDY, keep_session=True) for i in range(4)]
    for s in streams:
        s.result()
    blocks, block_bytes = _blocks(tiny_engine), tiny_engine.runner.blocks.block_bytes
    r = tiny_engine.memory_report()
    # The first request's two prompt blocks are read by all four sessions; each has its own tail.
    assert r.kv_shared_bytes == 2 * block_bytes
    assert r.kv_private_bytes == 4 * block_bytes  # 41 + 5 positions: a third block each
    assert r.kv_references == 2 * 4 + 4  # what unshared KV would hold, in blocks
    for s in streams:
        s.session.close()
    use = blocks.usage()
    assert use["references"] == 0 and use["shared"] == use["private"] == 0
    assert use["cached"] > 0 and use["cached"] + use["free"] == blocks.blocks  # published prefixes stay, evictable


def test_eviction_never_frees_a_referenced_block(tiny_bundle):
    with onecopy.Engine.load(tiny_bundle, kv_blocks=8, max_sessions=3) as engine:
        blocks = _blocks(engine)
        holder = engine.submit(PROMPT, GREEDY, keep_session=True)
        holder.result()
        held = set(blocks.owned[holder.session.row])
        before = _state(holder.session)
        for i in range(6):  # distinct prompts: each publishes blocks, later ones evict earlier ones
            prompt = [100 + i] * 40
            assert engine.submit(prompt, GREEDY).result()
        assert blocks.index.evictable <= blocks.blocks - len(held)
        assert all(blocks.refs[b] == 1 for b in held)
        after = _state(holder.session)
        for k in before:
            assert torch.equal(before[k], after[k]), k
        holder.session.close()
        assert blocks.usage()["references"] == 0


def test_capacity_counts_blocks(tiny_bundle):
    with onecopy.Engine.load(tiny_bundle, kv_blocks=3, max_sessions=4, prefix_cache=False) as engine:
        assert engine.memory_report().kv_blocks == 3
        with pytest.raises(onecopy.SessionCapacityError,
                           match=r"may write 64 positions \(4 KV blocks of 16\) and the whole KV cache has 3 blocks"):
            engine.submit(list(range(3, 60)), SamplingParams(max_new_tokens=8))
        # Two requests of three blocks each: the second waits for the first's blocks, then runs.
        params = SamplingParams(max_new_tokens=4, temperature=0)
        a, b = (engine.submit(list(range(3 + i, 43 + i)), params) for i in range(2))
        assert len(a.result()) == 4 and len(b.result()) == 4
        s = engine.open_session()
        with pytest.raises(onecopy.SessionCapacityError, match=r"the KV cache is full: writing positions 0\.\.63 needs 4"):
            s.prefill(list(range(3, 67)))
        assert _blocks(engine).owned[s.row] == [] and s.position == 0  # refused before anything was taken
        s.prefill(list(range(3, 43)))  # what fits still runs
        s.close()


def test_snapshot_of_a_session_on_shared_blocks_restores_elsewhere(tiny_engine, uncached):
    tiny_engine.submit(PROMPT, GREEDY).result()
    stream = tiny_engine.submit(PROMPT + [70], GREEDY, keep_session=True)
    stream.result()
    assert stream.cached_tokens == 32
    s = stream.session
    snap = s.snapshot()
    more = SamplingParams(max_new_tokens=5, temperature=0)
    expected = list(s.generate_ids([80, 81], more))
    with uncached.open_session(restore=snap) as r:
        assert r.position == snap.position
        assert list(r.generate_ids([80, 81], more)) == expected
    s.close()


def test_direct_calls_on_a_session_own_their_blocks(tiny_engine):
    a = tiny_engine.open_session()
    a.prefill(PROMPT)
    b = tiny_engine.open_session()
    b.prefill(PROMPT)
    blocks = _blocks(tiny_engine)
    assert not set(blocks.owned[a.row]) & set(blocks.owned[b.row])  # direct sessions never share
    sa, sb = _state(a), _state(b)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    a.reset()
    assert blocks.owned[a.row] == [] and a.position == 0
    a.close()
    b.close()


def test_server_reports_cached_tokens_and_kv_blocks(tiny_bundle):
    import httpx
    import openai

    from onecopy.serve import BackgroundServer, ServerConfig

    with onecopy.Engine.load(tiny_bundle, max_sessions=2) as engine, \
            BackgroundServer(engine, ServerConfig(model_name="tiny")) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        first = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        again = c.completions.create(model="tiny", prompt=PROMPT + [9], max_tokens=4, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == 32
        assert server.app.state.onecopy.cache is None  # the prefix cache serves chat turns too
        text = httpx.get(server.url + "/metrics").text
        assert 'onecopy_kv_blocks{kind="cached"} 2.0' in text and "onecopy_prefix_reused_tokens_total 32.0" in text
    with onecopy.Engine.load(tiny_bundle, max_sessions=2, prefix_cache=False) as engine, \
            BackgroundServer(engine, ServerConfig(model_name="tiny")) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
        again = c.completions.create(model="tiny", prompt=PROMPT + [9], max_tokens=4, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("chunk, admitted", [(512, [1, 2, 3]), (16, [1])])
def test_a_deterministic_prompt_waits_for_a_shared_prefill_only_where_its_cut_gains_from_it(chunk, admitted):
    """Two prompts share a 40-id opening (two blocks). A prompt that would find the other's blocks waits for its
    prefill (and the queue behind it, in order), but a deterministic engine cuts a hit back to a multiple of its
    prefill chunk: with chunks of 512 the two blocks give nothing, so all three are admitted at once."""
    from onecopy.runtime.kv_manager import KVSpec
    from onecopy.runtime.request import Request
    from onecopy.runtime.scheduler import Scheduler

    s = Scheduler(4, max_seq_len=1024, has_prefill=True, prefill_chunk=chunk,
                  kv=KVSpec(256, 64, 16, True, aligned=chunk))
    opening, params = list(range(1000, 1040)), SamplingParams(max_new_tokens=4, temperature=0)
    for i, prompt in enumerate((opening + list(range(300)), opening + list(range(500, 800)), list(range(2000, 2100)))):
        s.add(Request(i + 1, prompt, params, frozenset()))
    assert [r.id for r in s.admit()] == admitted


def test_a_prompt_ending_inside_a_cached_block_copies_it_and_the_longer_prefix_stays_cached(tiny_engine):
    """A prompt whose every block is cached prefills its last id into a copy of its last block: the cached block,
    and the longer prefix published under it, stay cached for the next prompt (it was overwritten and
    unpublished, the longer prefix with it)."""
    a = list(range(100, 156))  # 56 ids: three whole blocks
    tiny_engine.submit(a, GREEDY).result()
    short = tiny_engine.submit(a[:32], GREEDY)
    short.result()
    assert short.cached_tokens == 31
    again = tiny_engine.submit(a, GREEDY)
    again.result()
    assert again.cached_tokens == 48
