"""GPU tests (run on an H100/H200 through the device tool; skipped where no CUDA GPU is visible).

    python -m pytest -p no:logging -q tests/gpu
"""

import pytest
import torch

import onecopy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT = [5, 9, 33, 2, 71, 8, 19]
GREEDY = onecopy.SamplingParams(max_new_tokens=24)
REQUESTS = {
    "short": ([100, 3], GREEDY),
    "sampled": ([5, 9, 33, 2, 71, 8], onecopy.SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7,
                                                             max_new_tokens=30)),
    "long": (list(range(40, 90)), onecopy.SamplingParams(max_new_tokens=20, repetition_penalty=1.5)),
    "early": ([300, 301, 302], onecopy.SamplingParams(temperature=1.3, seed=3, max_new_tokens=3)),
    "late": ([11, 22, 33, 44], onecopy.SamplingParams(temperature=0.7, seed=99, max_new_tokens=24)),
}


@pytest.fixture(scope="module")
def cuda_bundle(tmp_path_factory):
    # max_seq_len 4096: 1 MiB of state per session (bf16), so pools and graphs are measurable.
    return onecopy.export("tiny-llama", tmp_path_factory.mktemp("b") / "tiny", max_seq_len=4096, device="cuda",
                          dtype="bfloat16", progress=False)


def used() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # count what is held, not what the allocator keeps cached
    free, total = torch.cuda.mem_get_info()
    return total - free


def _aoti_unloads_kernels() -> bool:
    """Whether this torch's AOTI runtime unloads the CUDA modules a package loaded (pytorch#184860)."""
    from pathlib import Path

    header = Path(torch.__file__).parent / "include/torch/csrc/inductor/aoti_runtime/model_base.h"
    return header.is_file() and "loaded_modules_" in header.read_text()


def _steps(engine, prompt, n):
    """Greedy decode n steps of one session; logits of every step (cloned) and the final state."""
    s = engine.open_session()
    logits = [s.prefill(prompt).clone()]
    for _ in range(n):
        logits.append(s.decode(logits[-1].argmax(-1)).clone())
    return s, logits


def test_graph_replay_equals_eager_bit_for_bit_over_64_steps(cuda_bundle):
    with onecopy.Engine.load(cuda_bundle, "cuda", max_sessions=8, cuda_graphs=False) as eager, \
            onecopy.Engine.load(cuda_bundle, "cuda", max_sessions=8, cuda_graphs=True) as graphs:
        assert graphs.graph_buckets == [1, 2, 4, 8] and eager.graph_buckets == []
        se, le = _steps(eager, PROMPT, 64)
        sg, lg = _steps(graphs, PROMPT, 64)
        for i, (a, b) in enumerate(zip(le, lg)):
            assert torch.equal(a, b), f"step {i} differs"
        for k in se.state:
            assert torch.equal(se.state[k], sg.state[k]), k


def test_decode_graphs_share_one_output_and_every_bucket_gives_eager_bits(cuda_bundle):
    """Past 128 rows the graphs come in steps of 32 (a padded row costs what a real one does there), all writing
    the largest graph's output. 300 deterministic requests of different lengths, their batch shrinking through
    every bucket as they end: the ids of eager steps, and every bucket's logits a view of one buffer."""
    from onecopy.runtime.step import default_buckets

    reqs = [([5 + i % 200, 9, 33 + i % 7], onecopy.SamplingParams(max_new_tokens=2 + i % 40, temperature=0.8 * (i % 2),
                                                                  seed=i)) for i in range(300)]
    ids = []
    for graphs in (True, False):
        with onecopy.Engine.load(cuda_bundle, "cuda", max_sessions=300, deterministic=True, cuda_graphs=graphs) as engine:
            if graphs:
                assert engine.graph_buckets == default_buckets(300) == [1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 224,
                                                                         256, 288, 300]
            streams = [engine.submit(p, sp, stop_ids=[]) for p, sp in reqs]
            ids.append([s.result(timeout=300) for s in streams])
            if graphs:
                step = engine.runner.step
                step.rows.fill_(engine.runner.pool.scratch)  # replays below write the scratch row alone
                assert len({step.graphs.replay(b).data_ptr() for b in engine.graph_buckets}) == 1
    assert ids[0] == ids[1]


def _alone(engine, prompt, params):
    with engine.open_session() as s:
        ids = s.submit(prompt, params, stop_ids=[]).result(timeout=120)
        return ids, {k: v.clone() for k, v in s.state.items()}


def _without_invariant_decode(bundle, dst):
    """The bundle as an onecopy before the batch-invariant decode wrote it: one decode."""
    import json

    from ..conftest import copy_bundle

    copy = copy_bundle(bundle, dst)
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["methods"]["decode_invariant"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.parametrize("decode", ["batched-invariant", "one-row-per-call"])
def test_deterministic_concurrent_sessions_with_graphs_equal_solo(cuda_bundle, decode, tmp_path):
    """Sessions joining and leaving mid-run, bit-identical to each alone: batched in graphs of 1 to 8 rows
    by the batch-invariant decode, or (a bundle without one) the fast decode one row per call in the 1-row graph."""
    bundle = cuda_bundle if decode == "batched-invariant" else _without_invariant_decode(cuda_bundle, tmp_path / "b")
    with onecopy.Engine.load(bundle, "cuda", max_sessions=8, deterministic=True, prefill_chunk=16) as engine:
        if decode == "batched-invariant":
            assert engine.graph_buckets == [1, 2, 4, 8] and engine.role_method("decode") == "decode_invariant"
        else:
            assert engine.graph_buckets == [1] and engine.role_method("decode") == "decode"
        solo = {k: _alone(engine, p, sp) for k, (p, sp) in REQUESTS.items()}
        sessions = {k: engine.open_session() for k in REQUESTS}
        streams = {k: sessions[k].submit(*REQUESTS[k], stop_ids=[]) for k in ("short", "sampled", "long", "early")}
        for _ in streams["short"]:
            if len(streams["short"].ids) == 5:
                break
        streams["late"] = sessions["late"].submit(*REQUESTS["late"], stop_ids=[])
        for k, stream in streams.items():
            assert stream.result(timeout=120) == solo[k][0], k
            for fqn, t in sessions[k].state.items():
                assert torch.equal(t, solo[k][1][fqn]), (k, fqn)


def test_cuda_bundles_have_a_fast_and_a_batch_invariant_decode(cuda_bundle):
    manifest = onecopy.bundle.read_manifest(cuda_bundle)
    assert {n: m.batch_invariant for n, m in manifest.methods.items() if m.role == "decode"} == {
        "decode": False, "decode_invariant": True}
    with onecopy.Engine.load(cuda_bundle, "cuda", max_sessions=2, cuda_graphs=False) as engine:
        assert engine.role_method("decode") == "decode" and "decode_invariant" not in engine.methods


def test_invariant_decode_is_batch_invariant_on_cuda(cuda_bundle):
    """Logits and state row of one session, bit for bit, at row 0 of 3 alone and at row 5 of 8 (batch index
    0 of 1, 1 of 2, 5 of 8, 5 of 6), row 17 of 24 and row 5 of 70 (two 64-row blocks) among neighbours."""
    from ..invariance import assert_invariant

    with onecopy.Engine.load(cuda_bundle, "cuda", max_sessions=2, deterministic=True, cuda_graphs=False) as engine:
        assert_invariant(engine)


def test_padding_in_graphs_never_touches_free_rows(cuda_bundle):
    """Canary: 3 sessions ride the 4-row graph; the padding entry writes only the scratch row."""
    with onecopy.Engine.load(cuda_bundle, "cuda", max_sessions=8) as engine:
        sessions = [engine.open_session() for _ in range(3)]
        pool = engine.runner.pool
        free = [r for r in range(pool.rows + 1) if r not in {s.row for s in sessions}]
        for t in pool.tensors.values():
            t[free] = 3.0
        streams = [s.submit([7 + i, 8, 9], GREEDY, stop_ids=[]) for i, s in enumerate(sessions)]
        for st in streams:
            st.result(timeout=120)
        for fqn, t in pool.tensors.items():
            for r in free:
                if r != pool.scratch:
                    assert bool((t[r] == 3.0).all()), (fqn, r)
            assert not bool((t[pool.scratch] == 3.0).all()), fqn


def test_device_memory_is_sized_at_load_and_returned_at_close(cuda_bundle):
    with onecopy.Engine.load(cuda_bundle, "cuda", max_sessions=4) as warm:  # the process's first engine
        list(warm.open_session().generate_ids(PROMPT, onecopy.SamplingParams(max_new_tokens=4)))
    before = used()
    engine = onecopy.Engine.load(cuda_bundle, "cuda", max_sessions=16)
    r = engine.memory_report()
    loaded = used()
    assert r.pool_bytes >= 16 * r.state_bytes_per_session and r.graph_bytes > 0 and r.graph_buckets == [1, 2, 4, 8, 16]
    held = r.resident_weight_bytes + r.pool_bytes
    assert held <= loaded - before <= held + r.graph_bytes + 64 * 2**20  # + workspace, sampler, allocator rounding
    engine.submit(PROMPT, GREEDY).result()  # first request: eager prefill's cuBLAS workspace on this stream
    warmed = used()
    assert warmed - loaded <= 64 * 2**20
    sessions = [engine.open_session() for _ in range(16)]
    streams = [s.submit([3 + i, 4, 5], GREEDY) for i, s in enumerate(sessions)]
    [st.result() for st in streams]
    assert used() == warmed  # sessions take rows of the pool: no device memory moves
    for s in sessions:
        s.close()
    assert used() == warmed
    engine.close()
    # A second engine in the process gives everything back, but for the kernel code its packages
    # loaded where this torch's AOTI never unloads it (pytorch#184860 added cuModuleUnload; torch
    # 2.11 lacks it): the driver holds code in 2 MiB chunks, so at most one chunk may stay.
    assert used() - before <= (0 if _aoti_unloads_kernels() else 2 * 2**20)


@pytest.mark.parametrize("graphs", [False, True])
def test_only_sampled_ids_cross_to_the_host(cuda_bundle, graphs):
    """The profiler's device-to-host copies during generation: exactly one per step (the step's ids)."""
    from torch.profiler import ProfilerActivity, profile

    with onecopy.Engine.load(cuda_bundle, "cuda", max_sessions=4, cuda_graphs=graphs) as engine:
        params = onecopy.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=1, repetition_penalty=1.2,
                                        max_new_tokens=16)
        streams = [engine.submit(PROMPT, params, stop_ids=[]) for _ in range(2)]  # warm up
        [s.result() for s in streams]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            streams = [engine.submit(p, params, stop_ids=[]) for p in (PROMPT, PROMPT[:3])]
            out = [s.result() for s in streams]
        steps = engine.scheduler.stats.decode_steps
    d2h = [e for e in prof.events() if "DtoH" in e.name or "Device -> Host" in e.name or "DeviceToHost" in e.name]
    d2h_memcpy = [e for e in d2h if e.device_type == torch.autograd.DeviceType.CUDA] or d2h
    assert [len(o) for o in out] == [16, 16]
    # Both prompts are prefilled in the first two iterations, then every step samples both rows at once.
    assert 16 <= len(d2h_memcpy) <= 18, sorted({e.name for e in prof.events() if "emcpy" in e.name})
    assert steps > 0


def test_graphs_need_a_shared_weight_decode(tmp_path):
    only_prefill = onecopy.export("tiny-llama", tmp_path / "p", max_seq_len=64, device="cuda", methods=("prefill",),
                                  progress=False)
    with pytest.raises(onecopy.InputError, match="cuda_graphs=True needs a 'decode' method .* cuda_graphs=False"):
        onecopy.Engine.load(only_prefill, "cuda", cuda_graphs=True)
    with onecopy.Engine.load(only_prefill, "cuda", max_sessions=2) as engine:  # the default simply runs without graphs
        assert not engine.cuda_graphs


def test_decode_attention_kernel_matches_float64():
    """The Triton split-KV kernel against a float64 reference, on random data, lengths from 1 to full; 130 rows
    of 8 KV heads take one program per row and head (`tiles.decode_splits`), the others every split."""
    from onecopy import kernels
    from onecopy.models.attention import pooled_attention

    torch.manual_seed(0)
    assert kernels.tiles.decode_splits(130, 8, kernels.n_splits(512)) == 1 < kernels.n_splits(512)
    for b, hq, hkv, d, s, p in [(3, 4, 2, 16, 64, 5), (17, 32, 8, 128, 2048, 20), (5, 9, 3, 64, 700, 6), (2, 6, 6, 64, 1500, 3),
                                (130, 32, 8, 128, 512, 132)]:
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        kp = torch.randn(p, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        vp = torch.randn_like(kp)
        rows = torch.randint(0, p, (b,), device="cuda")
        lengths = torch.randint(1, s + 1, (b,), device="cuda")
        lengths[0], lengths[-1] = s, 1
        out = kernels.decode_attention(q, kp, vp, rows, lengths)
        ref = pooled_attention(q.cpu().double(), kp.cpu().double(), vp.cpu().double(), rows.cpu(), lengths.cpu())
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err < 1e-2, (b, hq, hkv, d, s, err)


def _rope_inputs(b, hq, hkv, d, s):
    """Random inputs of the decode-with-RoPE kernels: projected rows qkv [b, (hq + 2 hkv) d], cos and sin
    [b, d] of random angles, row pools [b + 1, hkv, s, d] (bf16, CUDA)."""
    qkv = torch.randn(b, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(b, d // 2, device="cuda") * 6.28
    cos, sin = (f(torch.cat((angles, angles), -1)).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    kp = torch.randn(b + 1, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    return qkv, cos, sin, kp, torch.randn_like(kp)


def _rope_write_attend_float64(qkv, cos, sin, kp_ref, vp_ref, rows, positions, hq, hkv, written=None):
    """The float64 reference of the decode-with-RoPE kernels: RoPE on q and the new k of each row of
    ``qkv`` [B, (hq + 2 hkv) D], the new k/v written into ``kp_ref``/``vp_ref`` (float64 row pools, in
    place) at row rows[i], position positions[i], and q's attention through that position. ``written``:
    the (k, v) [B, Hkv, D] to cache instead (an 8-bit kernel's stored values, dequantized)."""
    from onecopy.models.attention import pooled_attention
    from onecopy.models.layers import rotate_half

    b, d = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv)
    q, k, v = qkv.cpu().double().split([hq * d, hkv * d, hkv * d], dim=-1)
    c, sn = cos.cpu().double()[:, None], sin.cpu().double()[:, None]
    q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)
    q, k = q * c + rotate_half(q) * sn, k * c + rotate_half(k) * sn
    if written is not None:
        k, v = written
    for i, (r, p) in enumerate(zip(rows.tolist(), positions)):
        kp_ref[r, :, p], vp_ref[r, :, p] = k[i], v[i]
    return pooled_attention(q, kp_ref, vp_ref, rows.cpu(), torch.tensor(positions) + 1)


def test_decode_attention_with_rope_and_cache_write_matches_float64():
    """The decode kernel fed the projected q/k/v rows: RoPE on q and the new k, the new k/v cached at each
    row's position (and nothing else of the pool touched), attention through that position, against
    float64 torch ops: first position, mid-block, block and split boundaries, the pool's last position."""
    from onecopy import kernels

    torch.manual_seed(0)
    for hq, hkv, d, s, positions in [(32, 8, 128, 4097, [0, 1023, 4096]), (4, 2, 64, 300, [63, 64, 299]),
                                     (6, 6, 64, 1500, [256, 1000]),
                                     (32, 8, 128, 1024, [0, 63, 64] + list(range(100, 1024, 15)))]:  # 65 rows: unsplit
        b = len(positions)
        qkv, cos, sin, kp, vp = _rope_inputs(b, hq, hkv, d, s)
        rows = torch.tensor(list(range(b, 0, -1)), device="cuda")  # not the identity: rows are looked up
        pos = torch.tensor(positions, device="cuda")
        kp_ref, vp_ref = kp.cpu().double(), vp.cpu().double()
        out = kernels.decode_attention_rope(qkv, cos, sin, kp, vp, rows, pos)

        ref = _rope_write_attend_float64(qkv, cos, sin, kp_ref, vp_ref, rows, positions, hq, hkv)
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert out.shape == (b, hq, d) and err < 1e-2, (hq, hkv, d, s, positions, err)
        torch.testing.assert_close(kp.cpu().double(), kp_ref, rtol=0.02, atol=0.02)  # only the new k, roped
        assert torch.equal(vp.cpu().double(), vp_ref)  # exactly the new v, nothing else


def test_prefill_attention_kernel_matches_float64():
    """The Triton prefill kernel against a float64 reference: fresh prompts and chunks after a filled prefix,
    head sizes 16 to 256, lengths that are and are not multiples of the tiles."""
    from onecopy import kernels
    from onecopy.models.attention import prefill_attention

    torch.manual_seed(0)
    for hq, hkv, d, s, start, t in [(4, 2, 16, 64, 0, 7), (32, 8, 128, 2048, 0, 1024), (32, 8, 128, 2048, 640, 129),
                                    (32, 8, 64, 4096, 1000, 1), (16, 2, 256, 700, 63, 300), (6, 6, 64, 1500, 0, 1499)]:
        q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
        kp = torch.randn(3, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        vp = torch.randn_like(kp)
        rows = torch.tensor([2], device="cuda")
        pos = torch.arange(start, start + t, device="cuda")
        out = kernels.prefill_attention(q, kp, vp, rows, pos)
        ctx = torch.arange(start + t)
        ref = prefill_attention(q.cpu().double(), kp.cpu().double(), vp.cpu().double(), rows.cpu(), pos.cpu(), ctx)
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err < 1e-2, (hq, hkv, d, s, start, t, err)


def _kernel_names(fn) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def test_decode_fuses_projections_for_few_sessions_and_keeps_cublas_for_more(cuda_bundle):
    """Up to 16 sessions a decode step runs the fused small-linear kernel, each row bit for bit what it
    gives alone (the kernel's rows are independent); 17 go through cuBLAS and agree to bf16 rounding."""
    from onecopy import kernels

    assert kernels.SMALL_LINEAR_ROWS == 16
    with onecopy.Engine.load(cuda_bundle, "cuda", max_sessions=24, cuda_graphs=False) as engine:
        sessions = [engine.open_session() for _ in range(17)]
        for i, s in enumerate(sessions):
            s.prefill(PROMPT + [i, 3 * i])
        rows, pos = [s.row for s in sessions], [s.position for s in sessions]
        tokens = torch.arange(17, device="cuda") * 5 + 1
        alone = [engine.runner.decode(rows[i:i + 1], pos[i:i + 1], tokens[i:i + 1]).clone() for i in range(17)]
        names: dict[int, set[str]] = {}
        out: dict[int, torch.Tensor] = {}
        for n in (16, 17):
            names[n] = _kernel_names(lambda n=n: out.__setitem__(n, engine.runner.decode(rows[:n], pos[:n], tokens[:n]).clone()))
        assert any("linear_kernel" in k for k in names[16]), sorted(names[16])
        assert not any("linear_kernel" in k for k in names[17]), sorted(names[17])
        for i in range(16):
            assert torch.equal(out[16][i], alone[i][0]), i
        for i in range(17):
            torch.testing.assert_close(out[17][i].float(), alone[i][0].float(), rtol=0.05, atol=0.05)


def test_small_linear_kernel_matches_float64():
    """The fused kernel (plain, RMSNorm before, SwiGLU after, residual add after) against float64 torch
    ops, 1 to 16 rows, shapes that are and are not multiples of its tiles; and the partial sums of squares
    it returns add up to each output row's, the norm a following kernel folds in."""
    from onecopy import kernels
    from onecopy.models.projections import sum_of_squares

    torch.manual_seed(0)
    for m, n, k, glu, res, norm in [(1, 6144, 4096, False, False, True), (16, 4096, 4096, False, True, False),
                                    (5, 2 * 1000, 4096, True, False, True), (3, 100, 72, False, True, True),
                                    (16, 2 * 96, 14336, True, False, False), (1, 130, 8, False, False, False),
                                    (2, 128256, 4096, False, False, True)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        r = torch.randn(m, n // 2 if glu else n, device="cuda", dtype=torch.bfloat16) if res else None
        g = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
        # The norm's sums as a producing kernel would hand them over: split over several programs.
        parts = torch.stack([sum_of_squares(c)[:, 0] for c in x.chunk(7, dim=1)], dim=1) if norm else None
        out, ss = kernels.small_linear(x, w, r, glu, norm=(g, parts, 1e-5) if norm else None)
        xd = x.double().cpu()
        if norm:
            xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double().cpu()
        ref = xd @ w.double().cpu().t()
        if glu:
            gate, up = ref.chunk(2, dim=-1)
            ref = torch.nn.functional.silu(gate) * up
        if res:
            ref = ref + r.double().cpu()
        err = float((out.double().cpu() - ref).norm() / ref.norm())
        assert out.shape == ref.shape and err < 1e-2, (m, n, k, glu, res, norm, err)
        assert ss.shape == (m, kernels.small_linear_programs(out.shape[1], glu)) and ss.dtype == torch.float32
        torch.testing.assert_close(ss.sum(-1), sum_of_squares(out)[:, 0], rtol=1e-5, atol=1e-5)


def test_small_linear_rows_are_independent_of_the_batch():
    """A row's output and partial sums, bit for bit, at any batch size (1 to 130) and any index in it, with
    16 rows per program (up to 16 rows) and 64: the same as that row alone; and with the batch-invariant
    decode's tiles a row's output is the same from a 64-row program as from a 16-row one (its partial
    sums are not: the invariant decode does not fold norms). Plain, norm folded in, SwiGLU, residual."""
    from onecopy import kernels
    from onecopy.models.projections import sum_of_squares

    torch.manual_seed(1)
    for n, k, glu, res, norm in ((6144, 4096, False, False, True), (2 * 1000, 4096, True, False, True),
                                 (4096, 14336, False, True, False), (130, 72, False, True, True),
                                 (128256, 4096, False, False, False)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        g = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
        x0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        r0 = torch.randn(1, n // 2 if glu else n, device="cuda", dtype=torch.bfloat16) if res else None

        def parts_of(x):  # the partial sums a producing kernel hands over, split over 5 programs
            return torch.stack([sum_of_squares(c)[:, 0] for c in x.chunk(5, dim=1)], dim=1)

        def run(x, parts, r, block_m, inv):
            return kernels.small_linear(x, w, r, glu, norm=(g, parts, 1e-5) if norm else None, block_m=block_m,
                                        invariant=inv)

        p0 = parts_of(x0)
        for inv, block_m, sizes in ((False, kernels.SMALL_LINEAR_ROWS, (1, 2, 7, 16)),
                                    (True, kernels.SMALL_LINEAR_ROWS, (1, 2, 7, 16)),
                                    (True, kernels.INVARIANT_ROWS, (1, 2, 16, 17, 64, 65, 130))):
            ref_ss = run(x0, p0, r0, block_m, inv)[1]  # sums: reduced in an order that depends on block_m
            if block_m == kernels.SMALL_LINEAR_ROWS:
                ref = run(x0, p0, r0, block_m, inv)[0]  # 64-row programs: compared with the 16-row one's rows
            for m in sizes:
                for i in sorted({0, m // 2, m - 1}):
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    x[i] = x0[0]
                    r = None
                    if res:
                        r = torch.randn(m, r0.shape[1], device="cuda", dtype=torch.bfloat16)
                        r[i] = r0[0]
                    parts = parts_of(x)
                    parts[i] = p0[0]
                    out, ss = run(x, parts, r, block_m, inv)
                    assert torch.equal(out[i], ref[0]) and torch.equal(ss[i], ref_ss[0]), (inv, block_m, n, k, m, i)


def _paged(pool, bs, table=None):
    """Pool rows [P, Hkv, S, D] scattered into shuffled pages [P S / bs + 3, Hkv, bs, D] (3 pages that no row
    names, of noise) and the block table [P, S / bs] that maps them back; ``table``: reuse that layout."""
    p, h, s, d = pool.shape
    nb = p * (s // bs)
    if table is None:
        table = torch.randperm(nb + 3, device=pool.device)[:nb].view(p, s // bs)
    pages = torch.randn(nb + 3, h, bs, d, device=pool.device, dtype=pool.dtype)
    pages[table.flatten()] = pool.view(p, h, s // bs, bs, d).transpose(1, 2).flatten(0, 1)
    return pages, table


def _rows_of(pages, table):
    """The rows [P, Hkv, NBMAX bs, D] that a block table reads from pages (the inverse of `_paged`)."""
    return pages[table].transpose(1, 2).flatten(2, 3)


@pytest.mark.parametrize("bs", [16, 64])
def test_paged_decode_attention_equals_the_row_kernel_bit_for_bit(bs):
    """The paged decode kernel over rows scattered into shuffled pages: bit for bit the row kernel over the
    same rows (same splits, same reduction order), and against a float64 reference."""
    from onecopy import kernels
    from onecopy.models.attention import pooled_attention

    torch.manual_seed(0)
    for b, hq, hkv, d, s, p in [(5, 6, 2, 64, 704, 6), (17, 32, 8, 128, 2048, 20), (3, 4, 2, 16, 64, 5)]:
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        kp = torch.randn(p, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        vp = torch.randn_like(kp)
        kpg, table = _paged(kp, bs)
        vpg, _ = _paged(vp, bs, table)
        rows = torch.randint(0, p, (b,), device="cuda")
        lengths = torch.randint(1, s + 1, (b,), device="cuda")
        lengths[0], lengths[-1] = s, 1
        out = kernels.paged_decode_attention(q, kpg, vpg, table, rows, lengths)
        assert torch.equal(out, kernels.decode_attention(q, kp, vp, rows, lengths)), (b, hq, hkv, d, s, bs)
        ref = pooled_attention(q.cpu().double(), kp.cpu().double(), vp.cpu().double(), rows.cpu(), lengths.cpu())
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err < 1e-2, (b, hq, hkv, d, s, bs, err)


@pytest.mark.parametrize("bs", [16, 64])
def test_paged_decode_attention_with_rope_caches_into_the_right_page(bs):
    """The paged rope variant: bit for bit the row kernel's output, the new k/v cached in the pages the table
    names (the rows read back through it equal the row kernel's pools; pages no row names untouched), and
    against float64: first position, page and split boundaries, the last position."""
    from onecopy import kernels

    torch.manual_seed(0)
    for hq, hkv, d, s, positions in [(32, 8, 128, 4096, [0, bs - 1, bs, 1023, 4095]),
                                     (6, 2, 64, 704, [63, 64, 300, 703])]:
        b = len(positions)
        qkv, cos, sin, kp, vp = _rope_inputs(b, hq, hkv, d, s)
        kpg, table = _paged(kp, bs)
        vpg, _ = _paged(vp, bs, table)
        spare = torch.ones(kpg.shape[0], dtype=torch.bool, device="cuda")
        spare[table.flatten()] = False
        k_spare, v_spare = kpg[spare].clone(), vpg[spare].clone()
        rows = torch.tensor(list(range(b, 0, -1)), device="cuda")
        pos = torch.tensor(positions, device="cuda")
        kp_ref, vp_ref = kp.cpu().double(), vp.cpu().double()
        out_rows = kernels.decode_attention_rope(qkv, cos, sin, kp, vp, rows, pos)
        out = kernels.paged_decode_attention_rope(qkv, cos, sin, kpg, vpg, table, rows, pos)
        assert torch.equal(out, out_rows), (hq, hkv, d, s, bs)
        assert torch.equal(_rows_of(kpg, table), kp) and torch.equal(_rows_of(vpg, table), vp)
        assert torch.equal(kpg[spare], k_spare) and torch.equal(vpg[spare], v_spare)

        ref = _rope_write_attend_float64(qkv, cos, sin, kp_ref, vp_ref, rows, positions, hq, hkv)
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err < 1e-2, (hq, hkv, d, s, bs, err)
        torch.testing.assert_close(_rows_of(kpg, table).cpu().double(), kp_ref, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("bs", [16, 64])
def test_paged_prefill_attention_equals_the_row_kernel_bit_for_bit(bs):
    """The paged prefill kernel over a row scattered into shuffled pages: bit for bit the row kernel (fresh
    prompts and chunks after a prefix, head sizes 64 to 256), and against a float64 reference."""
    from onecopy import kernels
    from onecopy.models.attention import prefill_attention

    torch.manual_seed(0)
    for hq, hkv, d, s, start, t in [(6, 2, 64, 704, 0, 700), (32, 8, 128, 2048, 640, 129), (16, 2, 256, 704, 63, 300),
                                    (32, 8, 64, 4096, 1000, 1)]:
        q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
        kp = torch.randn(3, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        vp = torch.randn_like(kp)
        kpg, table = _paged(kp, bs)
        vpg, _ = _paged(vp, bs, table)
        rows = torch.tensor([2], device="cuda")
        pos = torch.arange(start, start + t, device="cuda")
        out = kernels.paged_prefill_attention(q, kpg, vpg, table, rows, pos)
        assert torch.equal(out, kernels.prefill_attention(q, kp, vp, rows, pos)), (hq, hkv, d, s, start, t, bs)
        ctx = torch.arange(start + t)
        ref = prefill_attention(q.cpu().double(), kp.cpu().double(), vp.cpu().double(), rows.cpu(), pos.cpu(), ctx)
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err < 1e-2, (hq, hkv, d, s, start, t, bs, err)


def test_invariant_decode_attention_keeps_a_rows_splits_whatever_the_batch():
    """``invariant``: a row's attention is bit for bit the same alone and among 129 others (130 rows of 8 KV
    heads, where the default decode runs one program per row and head, `tiles.decode_splits`); one row alone
    gets the same splits either way; the default 130-row call is another (unsplit) reduction."""
    from onecopy import kernels

    torch.manual_seed(0)
    b, hq, hkv, d, s, bs = 130, 32, 8, 128, 1024, 16
    table = torch.randperm(b * s // bs, device="cuda").view(b, s // bs)
    kp = torch.randn(b * s // bs, hkv, bs, d, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(b, device="cuda")
    lengths = torch.randint(s // 2, s + 1, (b,), device="cuda")
    fixed = kernels.paged_decode_attention(q, kp, vp, table, rows, lengths, invariant=True)
    default = kernels.paged_decode_attention(q, kp, vp, table, rows, lengths)
    for i in (0, 33, 129):
        one = (q[i:i + 1], kp, vp, table, rows[i:i + 1], lengths[i:i + 1])
        alone = kernels.paged_decode_attention(*one, invariant=True)
        assert torch.equal(fixed[i], alone[0]), i
        assert torch.equal(kernels.paged_decode_attention(*one)[0], alone[0]), i
    assert not torch.equal(default, fixed)
    torch.testing.assert_close(default, fixed, rtol=2e-2, atol=2e-2)
