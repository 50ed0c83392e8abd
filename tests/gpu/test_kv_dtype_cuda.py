"""An 8-bit KV cache on CUDA: the ``_q8`` attention kernels against float64 references (reads and the
decode kernel's quantizing write), and int8/fp8 bundles: graph replay = eager bit for bit, the compiled
model = its eager ops, deterministic batches = solo runs."""

import json

import pytest
import torch

import onecopy
from onecopy.models import kv_quant

from .test_cuda import REQUESTS, _alone, _rope_inputs, _rope_write_attend_float64, _rows_of, _steps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FORMATS = ["int8", "fp8"]
NATIVE = [pytest.param(False, id="triton"), pytest.param(True, id="native")]  # kernels.native or the Triton op


def _pages(pool, bs, table):
    """Rows [P, H, S, *rest] (any dtype) as pages [P S / bs + 3, H, bs, *rest] laid out by ``table`` (test_cuda's
    `_paged` for 8-bit values and scales; `_rows_of` reads them back)."""
    p, h, s = pool.shape[:3]
    rest = pool.shape[3:]
    pages = torch.zeros(p * (s // bs) + 3, h, bs, *rest, device=pool.device, dtype=pool.dtype)
    pages[table.flatten()] = pool.view(p, h, s // bs, bs, *rest).transpose(1, 2).flatten(0, 1)
    return pages


def _quantized_pages(pool, dtype, bs, table):
    q, scale = kv_quant.quantize(pool, dtype)
    return _pages(q, bs, table), _pages(scale, bs, table), kv_quant.dequantize(q, scale).cpu().double()


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("fmt", FORMATS)
def test_q8_decode_and_prefill_kernels_match_float64_of_the_dequantized_cache(fmt, native):
    from onecopy import kernels
    from onecopy.models.attention import pooled_attention, prefill_attention

    dtype, bs = kv_quant.KV_DTYPES[fmt], 16
    torch.manual_seed(0)
    # 70 rows of 8 KV heads: one program per row and head (`tiles.decode_splits`); the others every split.
    for b, hq, hkv, d, s, p in [(5, 6, 2, 64, 704, 6), (17, 32, 8, 128, 2048, 20), (3, 4, 2, 16, 64, 5),
                                (70, 32, 8, 128, 512, 72)]:
        table = torch.randperm(p * s // bs + 3, device="cuda")[:p * s // bs].view(p, s // bs)
        kp = torch.randn(p, hkv, s, d, device="cuda", dtype=torch.bfloat16)
        vp = torch.randn_like(kp)
        kq, ks, k_ref = _quantized_pages(kp, dtype, bs, table)
        vq, vs, v_ref = _quantized_pages(vp, dtype, bs, table)
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        rows = torch.randint(0, p, (b,), device="cuda")
        lengths = torch.randint(1, s + 1, (b,), device="cuda")
        lengths[0], lengths[-1] = s, 1
        out = kernels.paged_decode_attention_q8(q, kq, vq, ks, vs, table, rows, lengths, native=native)
        ref = pooled_attention(q.cpu().double(), k_ref, v_ref, rows.cpu(), lengths.cpu())
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err < 1e-2, (fmt, b, hq, hkv, d, s, err)

        start, t = (s // 3, s - s // 3 - 1)
        qp = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(start, start + t, device="cuda")
        row = rows[:1]
        out = kernels.paged_prefill_attention_q8(qp, kq, vq, ks, vs, table, row, pos)
        ref = prefill_attention(qp.cpu().double(), k_ref, v_ref, row.cpu(), pos.cpu(), torch.arange(start + t))
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err < 1e-2, (fmt, hq, hkv, d, s, err)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("fmt", FORMATS)
def test_q8_rope_kernel_quantizes_the_new_kv_into_the_right_page(fmt, native):
    """The decode kernel with RoPE and the cache write, 8-bit: each new k/v stored as kv_quant stores it
    (its scale max|x| / QMAX, the values within a step of the float64 RoPE result), nothing else written,
    and the attention within 1e-2 of float64 over the dequantized cache, the new position's stored k/v included."""
    from onecopy import kernels

    dtype, bs, qmax = kv_quant.KV_DTYPES[fmt], 16, kv_quant.QMAX[kv_quant.KV_DTYPES[fmt]]
    torch.manual_seed(0)
    for hq, hkv, d, s, positions in [(32, 8, 128, 4096, [0, bs - 1, bs, 1023, 4095]),
                                     (6, 2, 64, 704, [63, 64, 300, 703]),
                                     (32, 8, 128, 1024, [0, 63, 64] + list(range(100, 1024, 15)))]:  # 65 rows: unsplit
        b = len(positions)
        qkv, cos, sin, kp, vp = _rope_inputs(b, hq, hkv, d, s)
        p = kp.shape[0]
        table = torch.randperm(p * s // bs + 3, device="cuda")[:p * s // bs].view(p, s // bs)
        kq, ks, k_ref = _quantized_pages(kp, dtype, bs, table)
        vq, vs, v_ref = _quantized_pages(vp, dtype, bs, table)
        before = [t.clone() for t in (kq, vq, ks, vs)]
        rows = torch.tensor(list(range(b, 0, -1)), device="cuda")
        pos = torch.tensor(positions, device="cuda")
        out = kernels.paged_decode_attention_rope_q8(qkv, cos, sin, kq, vq, ks, vs, table, rows, pos, native=native)
        k_st, v_st = k_ref.clone(), v_ref.clone()
        _rope_write_attend_float64(qkv, cos, sin, k_ref, v_ref, rows, positions, hq, hkv)  # the exact new k/v
        written = torch.zeros(p, s, dtype=torch.bool)
        written[rows.cpu(), pos.cpu()] = True
        r_idx, p_idx = written.nonzero(as_tuple=True)
        stored = []
        for pages, scales, full, old, old_s in ((kq, ks, k_ref, before[0], before[2]), (vq, vs, v_ref, before[1], before[3])):
            q_rows, s_rows = _rows_of(pages, table).cpu(), _rows_of(scales, table).cpu()  # [P, H, S, D], [P, H, S]
            q_new, s_new = q_rows[r_idx, :, p_idx], s_rows[r_idx, :, p_idx]  # [n, H, D], [n, H]
            want = full[r_idx, :, p_idx]  # the float64 RoPE'd k (or the v) the reference wrote
            got = kv_quant.dequantize(q_new, s_new).double()
            sc = s_new.double()[..., None]
            tol = sc * 0.5 if fmt == "int8" else want.abs() * 2**-4 + sc * 2**-9
            assert ((got - want).abs() <= tol + 0.02).all(), fmt  # + the bf16 RoPE's rounding
            assert (q_new.float().abs().amax(-1) == qmax).all()  # each vector's largest value hits QMAX
            old_rows = _rows_of(old, table).cpu()
            assert torch.equal(q_rows.permute(0, 2, 1, 3)[~written].view(torch.uint8),
                               old_rows.permute(0, 2, 1, 3)[~written].view(torch.uint8))  # nothing else written
            assert torch.equal(s_rows.permute(0, 2, 1)[~written], _rows_of(old_s, table).cpu().permute(0, 2, 1)[~written])
            stored.append(kv_quant.dequantize(q_rows[rows.cpu(), :, pos.cpu()], s_rows[rows.cpu(), :, pos.cpu()]).double())
        # The attention against float64 over what the cache now holds, the new position's 8-bit k/v included
        # (with the exact ones, fp8's 3-bit mantissa alone puts a first position's output ~2.5% off).
        ref = _rope_write_attend_float64(qkv, cos, sin, k_st, v_st, rows, positions, hq, hkv, written=stored)
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        assert err < 1e-2, (fmt, hq, hkv, d, s, err)
        spare = torch.ones(kq.shape[0], dtype=torch.bool, device="cuda")
        spare[table.flatten()] = False
        for now, was in zip((kq, vq, ks, vs), before):
            assert torch.equal(now[spare].view(torch.uint8), was[spare].view(torch.uint8))


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("fmt", FORMATS)
def test_q8_rope_kernel_stores_what_kv_quant_stores(fmt, native):
    """With RoPE the identity (cos 1, sin 0) the new k is the qkv row's k as is: the kernel's 8-bit values and
    scales equal kv_quant.quantize's of it (int8 rounded half to even, not truncated; at most a rare tie off by
    one step: the kernel's fp32 division is not correctly rounded)."""
    from onecopy import kernels

    dtype, bs, hq, hkv, d, s = kv_quant.KV_DTYPES[fmt], 16, 32, 8, 128, 256
    torch.manual_seed(1)
    b = 64
    qkv = torch.randn(b, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.ones(b, d, device="cuda", dtype=torch.bfloat16), torch.zeros(b, d, device="cuda", dtype=torch.bfloat16)
    p = b + 1
    table = torch.randperm(p * s // bs, device="cuda").view(p, s // bs)
    kq = torch.zeros(p * s // bs, hkv, bs, d, device="cuda", dtype=dtype)
    vq, ks, vs = torch.zeros_like(kq), torch.zeros(kq.shape[:3], device="cuda"), torch.zeros(kq.shape[:3], device="cuda")
    rows, pos = torch.arange(b, device="cuda"), torch.randint(0, s, (b,), device="cuda")
    kernels.paged_decode_attention_rope_q8(qkv, cos, sin, kq, vq, ks, vs, table, rows, pos, native=native)
    new_k, new_v = qkv[:, hq * d:].view(b, 2, hkv, d).unbind(1)
    for pages, scales, x in ((kq, ks, new_k), (vq, vs, new_v)):
        want_q, want_s = kv_quant.quantize(x, dtype)  # [b, hkv, d], [b, hkv]
        got_q, got_s = _rows_of(pages, table)[rows, :, pos], _rows_of(scales, table)[rows, :, pos]
        torch.testing.assert_close(got_s, want_s, rtol=1e-6, atol=0)
        diff = (got_q.float() - want_q.float()).abs()
        if fmt == "int8":
            assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3, ((diff > 0).sum(), diff.numel())
        else:
            assert ((diff > 0).float().mean() < 1e-3), (diff > 0).sum()


def _source(name):
    """tiny-llama (head_dim 16: the Triton decode), or the same with head_dim 64 ("hd64": the native decode)."""
    import dataclasses

    from onecopy.models.presets import random_hf_state_dict
    from onecopy.models.source import preset_source

    src = preset_source("tiny-llama")
    if name == "hd64":
        cfg = type(src.config).from_dict({**src.config.to_dict(), "dim": 256, "head_dim": 64,
                                                  "intermediate_size": 256})
        src = dataclasses.replace(src, name="tiny-llama-hd64", config=cfg, hf_state_dict=random_hf_state_dict(cfg, 0))
    return src


@pytest.fixture(scope="module", params=[(f, s) for f in FORMATS for s in ("tiny", "hd64")], ids=lambda p: "-".join(p))
def q8_bundle(request, tmp_path_factory):
    fmt, name = request.param
    src = _source(name)
    bundle = onecopy.export(src, tmp_path_factory.mktemp("b") / f"{fmt}-{name}", max_seq_len=512, device="cuda",
                            dtype="bfloat16", kv_dtype=fmt, progress=False)
    methods = json.loads((bundle / "manifest.json").read_text())["methods"]
    native = {op for m in methods.values() for op in m.get("native_ops", [])}
    assert native == ({"onecopy_native"} if name == "hd64" else set()), native  # head_dim 16: the Triton decode
    return fmt, bundle, src


def test_q8_graph_replay_equals_eager_bit_for_bit_and_the_eager_model(q8_bundle):
    fmt, bundle, src = q8_bundle
    with onecopy.Engine.load(bundle, "cuda", max_sessions=4, cuda_graphs=False) as eager, \
            onecopy.Engine.load(bundle, "cuda", max_sessions=4, cuda_graphs=True) as graphs:
        assert "float32 scale" in graphs.memory_report().kv_dtype
        prompt = [5, 9, 33, 2, 71, 8, 19] * 5
        se, le = _steps(eager, prompt, 48)
        sg, lg = _steps(graphs, prompt, 48)
        for i, (a, b) in enumerate(zip(le, lg)):
            assert torch.equal(a, b), f"step {i} differs"
        for k in se.state:
            assert torch.equal(se.state[k].view(torch.uint8), sg.state[k].view(torch.uint8)), k
    model = src.build(512, torch.bfloat16, "cuda")
    model.kv_block, model.kv_dtype = 16, kv_quant.KV_DTYPES[fmt]
    with torch.no_grad():
        want = [model(torch.tensor([prompt], device="cuda"), torch.arange(len(prompt), device="cuda"))]
        for i in range(48):
            tok = le[i].argmax(-1).view(1, 1)
            want.append(model(tok, torch.tensor([len(prompt) + i], device="cuda")))
    agree = sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(le, want))
    assert agree >= 45, agree  # bf16: cuBLAS vs the fused kernels' order


def test_q8_deterministic_concurrent_sessions_equal_solo(q8_bundle):
    _, bundle, _ = q8_bundle
    with onecopy.Engine.load(bundle, "cuda", max_sessions=8, deterministic=True, prefill_chunk=16) as engine:
        solo = {k: _alone(engine, p, sp) for k, (p, sp) in REQUESTS.items()}
        streams = {k: engine.submit(p, sp, stop_ids=[]) for k, (p, sp) in REQUESTS.items()}
        for k, stream in streams.items():
            assert stream.result(timeout=120) == solo[k][0], k


@pytest.mark.parametrize("kind", ["rows", "paged", "int8"])
def test_a_batched_prefill_launch_gives_each_chunk_the_bits_of_its_own_launch(kind):
    """Three equal-length chunks of three rows at different starts (a fresh prompt, chunks after prefixes) in
    one launch: each chunk's output is bit for bit its launch alone, for the row, paged and 8-bit paged kernels."""
    from onecopy import kernels

    from .test_cuda import _paged

    torch.manual_seed(0)
    p, hq, hkv, d, s, bs, t = 5, 32, 8, 128, 2048, 16, 200
    kp = torch.randn(p, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    rows = torch.tensor([4, 0, 2], device="cuda")
    pos = torch.stack([torch.arange(st, st + t, device="cuda") for st in (0, 640, 1500)])
    q = torch.randn(3, t, hq, d, device="cuda", dtype=torch.bfloat16)
    if kind == "rows":
        def attend(q, r, pos):
            return kernels.prefill_attention(q, kp, vp, r, pos)
    elif kind == "paged":
        kpg, table = _paged(kp, bs)
        vpg, _ = _paged(vp, bs, table)

        def attend(q, r, pos):
            return kernels.paged_prefill_attention(q, kpg, vpg, table, r, pos)
    else:
        table = torch.randperm(p * s // bs + 3, device="cuda")[:p * s // bs].view(p, s // bs)
        kq, ks, _ = _quantized_pages(kp, torch.int8, bs, table)
        vq, vs, _ = _quantized_pages(vp, torch.int8, bs, table)

        def attend(q, r, pos):
            return kernels.paged_prefill_attention_q8(q, kq, vq, ks, vs, table, r, pos)
    out = attend(q, rows, pos)
    assert out.shape == q.shape
    for i in range(3):
        assert torch.equal(out[i], attend(q[i], rows[i:i + 1], pos[i])), (kind, i)
