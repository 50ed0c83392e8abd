"""GPU tests (run on an H100/H200 through the device tool; skipped where no CUDA GPU is visible).

    python -m pytest -p no:logging -q tests/gpu
"""

import pytest
import torch

import onecopy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT = [5, 9, 33, 2, 71, 8, 19]


@pytest.fixture(scope="module")
def cuda_bundle(tmp_path_factory):
    # max_seq_len 8192: 4 MiB of state per session, so each session is its own allocator segment.
    return onecopy.export("tiny-llama", tmp_path_factory.mktemp("b") / "tiny", max_seq_len=8192, device="cuda",
                          dtype="bfloat16", progress=False)


def _steps(engine, prompt, n):
    """Greedy decode n steps; logits of every step (cloned) and the final state."""
    s = engine.open_session()
    logits = [s.prefill(prompt).clone()]
    for _ in range(n):
        logits.append(s.decode(logits[-1].argmax(-1)).clone())
    return s, logits


def test_graph_replay_equals_eager_bit_for_bit_over_64_steps(cuda_bundle):
    with onecopy.Engine.load(cuda_bundle, "cuda", cuda_graphs=False) as eager, \
            onecopy.Engine.load(cuda_bundle, "cuda", cuda_graphs=True) as graphs:
        assert graphs.memory_report().graph_slots == 1
        se, le = _steps(eager, PROMPT, 64)
        sg, lg = _steps(graphs, PROMPT, 64)
        assert sg._slot is not None and se._slot is None
        for i, (a, b) in enumerate(zip(le, lg)):
            assert torch.equal(a, b), f"step {i} differs"
        for k in se.state:
            assert torch.equal(se.state[k], sg.state[k]), k


def test_four_sessions_interleaved_with_graphs_equal_solo(cuda_bundle):
    prompts = [PROMPT, [1, 2], [100, 200, 3, 4, 5, 6, 7, 8, 9, 10], [42] * 5]
    with onecopy.Engine.load(cuda_bundle, "cuda") as engine:
        assert engine.cuda_graphs
        solo = []
        for p in prompts:
            with engine.open_session() as s:
                solo.append(list(s.generate_ids(p, onecopy.SamplingParams(max_new_tokens=32), stop_ids=[])))
        sessions = [engine.open_session() for _ in prompts]
        assert len({s._slot.index for s in sessions}) == 4
        streams = [s.generate_ids(p, onecopy.SamplingParams(max_new_tokens=32), stop_ids=[])
                   for s, p in zip(sessions, prompts)]
        got = [[] for _ in prompts]
        for _ in range(32):
            for i, it in enumerate(streams):
                got[i].append(next(it))
        assert got == solo
        r = engine.memory_report()
        assert r.graph_slots == 4 and r.graph_bytes > 0 and r.workspace_bytes > 0


def test_closed_slots_are_reused(cuda_bundle):
    with onecopy.Engine.load(cuda_bundle, "cuda") as engine:
        a = engine.open_session()
        slot = a._slot
        list(a.generate_ids(PROMPT, onecopy.SamplingParams(max_new_tokens=8)))
        a.close()
        b = engine.open_session()
        assert b._slot is slot and all(int(t.abs().sum()) == 0 for t in b.state.values())
        assert engine.memory_report().graph_slots == 1


def test_session_memory_returns_to_baseline_and_costs_its_state(cuda_bundle):
    def used():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # count what is held, not what the allocator keeps cached
        free, total = torch.cuda.mem_get_info()
        return total - free

    with onecopy.Engine.load(cuda_bundle, "cuda", cuda_graphs=False) as engine:
        with engine.open_session() as s:  # warm up kernels, cuBLAS handles, allocator
            list(s.generate_ids(PROMPT, onecopy.SamplingParams(max_new_tokens=4)))
        base = used()
        per = engine.session_bytes
        sessions = []
        for i in range(3):
            sessions.append(engine.open_session())
            grew = used() - base
            # Its state and nothing more, up to the caching allocator's granularity: requests under
            # 10 MiB share 20 MiB segments (larger ones round to 2 MiB; the benchmark shows those exact).
            assert per * (i + 1) <= grew <= per * (i + 1) + 20 * 2**20
        for s in sessions:
            s.close()
        assert used() == base
    before_load = used()
    with onecopy.Engine.load(cuda_bundle, "cuda", cuda_graphs=True) as engine:
        with engine.open_session() as s:
            list(s.generate_ids(PROMPT, onecopy.SamplingParams(max_new_tokens=4)))
    assert used() <= before_load  # engine.close() gives graphs, pool, workspace, weights back


@pytest.mark.parametrize("graphs", [False, True])
def test_only_sampled_ids_cross_to_the_host(cuda_bundle, graphs):
    """The profiler's device-to-host copies during generation: exactly one per generated token."""
    from torch.profiler import ProfilerActivity, profile

    with onecopy.Engine.load(cuda_bundle, "cuda", cuda_graphs=graphs) as engine, engine.open_session() as s:
        params = onecopy.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=1, repetition_penalty=1.2,
                                        max_new_tokens=16)
        list(s.generate_ids(PROMPT, params, stop_ids=[]))  # warm up
        s.reset()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = list(s.generate_ids(PROMPT, params, stop_ids=[]))
    d2h = [e for e in prof.events() if "DtoH" in e.name or "Device -> Host" in e.name or "DeviceToHost" in e.name]
    d2h_memcpy = [e for e in d2h if e.device_type == torch.autograd.DeviceType.CUDA] or d2h
    assert len(out) == 16
    assert len(d2h_memcpy) == 16, sorted({e.name for e in prof.events() if "emcpy" in e.name})


def test_graphs_need_a_shared_weight_decode(tmp_path):
    only_prefill = onecopy.export("tiny-llama", tmp_path / "p", max_seq_len=64, device="cuda", methods=("prefill",),
                                  progress=False)
    with pytest.raises(onecopy.InputError, match="cuda_graphs=True needs a 'decode' method .* cuda_graphs=False"):
        onecopy.Engine.load(only_prefill, "cuda", cuda_graphs=True)
    with onecopy.Engine.load(only_prefill, "cuda") as engine:  # the default simply runs without graphs
        assert not engine.cuda_graphs
