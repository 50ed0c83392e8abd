"""The prefix cache on CUDA: paged KV through the Triton kernels and the decode graphs.

    python -m pytest -p no:logging -q tests/gpu/test_prefix_cuda.py
"""

import threading

import pytest
import torch

import onecopy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SYSTEM = list(range(100, 100 + 200))  # 12.5 blocks of 16


@pytest.fixture(scope="module")
def paged_bundle(tmp_path_factory):
    return onecopy.export("tiny-llama", tmp_path_factory.mktemp("p") / "tiny", max_seq_len=1024, device="cuda",
                          dtype="bfloat16", methods=("prefill", "decode"), progress=False)


@pytest.fixture(scope="module")
def rows_bundle(tmp_path_factory):
    return onecopy.export("tiny-llama", tmp_path_factory.mktemp("r") / "tiny", max_seq_len=1024, device="cuda",
                          dtype="bfloat16", methods=("prefill", "decode"), kv_block=None, progress=False)


def _run(engine, prompts, params):
    streams = [engine.submit(p, q) for p, q in zip(prompts, params)]
    return [s.result() for s in streams], [s.cached_tokens for s in streams]


def test_paged_engine_equals_the_row_layout_and_shares_prompts(paged_bundle, rows_bundle):
    prompts = [SYSTEM + [7 + i, 9, 11 + i] for i in range(6)]
    params = [onecopy.SamplingParams(max_new_tokens=40, temperature=0.8, seed=i) for i in range(6)]
    with onecopy.Engine.load(rows_bundle, "cuda", max_sessions=8) as rows:
        want, _ = _run(rows, prompts, params)
    with onecopy.Engine.load(paged_bundle, "cuda", max_sessions=8, prefix_cache=False) as plain:
        assert plain.cuda_graphs
        got, cached = _run(plain, prompts, params)
        assert cached == [0] * 6
    assert got == want  # same kernels' arithmetic through the block table
    with onecopy.Engine.load(paged_bundle, "cuda", max_sessions=8) as engine:
        first, _ = _run(engine, prompts[:1], params[:1])
        rest, cached = _run(engine, prompts[1:], params[1:])
        assert cached == [192] * 5  # 12 full blocks of the system prompt
        r = engine.memory_report()
        assert r.kv_shared_bytes == 0 and r.kv_evictable_bytes > 0  # finished: published, evictable
    agree = sum(a == b for a, b in zip(first + rest, want))
    assert agree >= 5, (first + rest, want)  # a cached prefix prefills the rest from another cut (bf16)


def test_copy_on_write_keeps_the_holders_blocks_on_cuda(paged_bundle):
    with onecopy.Engine.load(paged_bundle, "cuda", max_sessions=4) as engine:
        prompt = SYSTEM[:192]  # whole blocks: the last token is written again into a shared block
        holder = engine.submit(prompt, onecopy.SamplingParams(max_new_tokens=8), keep_session=True)
        holder.result()
        before = {k: v[:, :holder.session.position].clone() for k, v in holder.session.state.items()}
        other = engine.submit(prompt, onecopy.SamplingParams(max_new_tokens=30, temperature=1.0, seed=5))
        other.result()
        assert other.cached_tokens == 191 and engine.scheduler.kv.copies >= 1
        after = holder.session.state
        for k, v in before.items():
            assert torch.equal(v, after[k][:, :v.shape[1]]), k
        holder.session.close()


def test_preempted_requests_equal_their_solo_runs_on_cuda(paged_bundle):
    """Blocks as the capacity through the decode graphs and overlapped steps: six requests of 15 blocks each on
    40 blocks preempt each other; deterministic, each one's ids and KV equal its run alone, bit for bit."""
    prompts = [SYSTEM[i:] + [7 + i, 9] for i in range(6)]
    params = [onecopy.SamplingParams(max_new_tokens=40, temperature=0.8, seed=i) for i in range(6)]

    def run(engine, which):
        streams = [engine.submit(prompts[i], params[i], stop_ids=[], keep_session=True) for i in which]
        out = [None] * len(streams)

        def collect(j):  # each kept session closed once read: its blocks free the others'
            ids = streams[j].result(timeout=120)
            out[j] = (ids, {k: v.clone() for k, v in streams[j].session.state.items()})
            streams[j].session.close()

        threads = [threading.Thread(target=collect, args=(j,)) for j in range(len(streams))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        return out

    with onecopy.Engine.load(paged_bundle, "cuda", max_sessions=6, kv_blocks=40, deterministic=True,
                             new_token_ratio=0.0) as engine:  # admitted on the blocks needed now: they preempt
        assert engine.loop.overlap and engine.cuda_graphs
        got = run(engine, range(6))
        assert engine.scheduler.stats.preemptions > 0 and engine.scheduler.kv.usage()["references"] == 0
    with onecopy.Engine.load(paged_bundle, "cuda", max_sessions=6, deterministic=True) as engine:
        alone = [run(engine, [i])[0] for i in range(6)]
    for (ids, state), (want_ids, want_state) in zip(got, alone):
        assert ids == want_ids
        for k in want_state:
            assert torch.equal(state[k], want_state[k]), k
    with onecopy.Engine.load(paged_bundle, "cuda", max_sessions=6, kv_blocks=40, new_token_ratio=0.0) as engine:
        assert all(len(ids) == 40 for ids, _ in run(engine, range(6)))
        assert engine.scheduler.stats.preemptions > 0


def test_batched_prefill_gives_the_tokens_of_one_call_per_chunk_on_cuda(paged_bundle, rows_bundle):
    """Eight prompts queued before the first step with a token budget: the chunks of one length go in one
    prefill call (tokens [N, T] through the batched kernel) and the requests' tokens are those of one call per
    chunk (bf16: the GEMMs see more rows, so a near tie may break another way in a sequence or two)."""
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=rng).tolist() for n in (300,) * 6 + (150,) * 2]
    params = onecopy.SamplingParams(max_new_tokens=16, temperature=0)
    for bundle in (paged_bundle, rows_bundle):
        runs = {}
        for batched in (True, False):
            with onecopy.Engine.load(bundle, "cuda", max_sessions=8, prefill_chunk=256, token_budget=4096,
                                     prefix_cache=False) as engine:
                assert engine.runner.batched_prefill
                engine.runner.batched_prefill = batched
                sizes = []
                prefill_chunks = engine.runner.prefill_chunks
                engine.runner.prefill_chunks = lambda chunks: sizes.append(len(chunks)) or prefill_chunks(chunks)
                hold = threading.Event()
                has_work = engine.scheduler.has_work
                engine.scheduler.has_work = lambda: hold.is_set() and has_work()
                streams = [engine.submit(p, params, stop_ids=[]) for p in prompts]
                hold.set()
                engine.loop.wake()
                runs[batched] = [s.result(timeout=120) for s in streams], sizes
        (got, sizes), (want, single) = runs[True], runs[False]
        # step 1: six 256-token first chunks (one call) and two 150-token prompts (one); step 2: six 44-token rests
        assert sizes == [6, 2, 6] and single == [1] * 14, (sizes, single)
        assert [g[0] for g in got] == [w[0] for w in want]
        assert sum(g == w for g, w in zip(got, want)) >= 6, (got, want)
