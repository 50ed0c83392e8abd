"""The CUDA C++ 8-bit decode attention (`kernels.native`) against the Triton op it replaces: the same function
within rounding, the splits and their bits independent of the batch in the batch-invariant mode, CUDA-graph
replay bit for bit, garbage past a row's length (fp8 NaN codes) never read into the result. The float64
references of both kernels are in test_kv_dtype_cuda.py (parametrized over ``native``)."""

import pytest
import torch

from onecopy.models import kv_quant

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FORMATS = ["int8", "fp8"]


def _inputs(fmt, b, hq, hkv, d, s, bs=16, seed=0, fill=None):
    """q [b, hq, d], 8-bit pages of b + 2 rows of s positions (shuffled), scales, a table, rows, lengths."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dtype = kv_quant.KV_DTYPES[fmt]
    p = b + 2
    nb = p * s // bs + 3
    table = torch.randperm(nb, device="cuda", generator=g)[:p * s // bs].view(p, s // bs)
    kf = torch.randn(nb, hkv, bs, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vf = torch.randn(nb, hkv, bs, d, device="cuda", dtype=torch.bfloat16, generator=g) * 0.01  # small v scales
    (kq, ks), (vq, vs) = kv_quant.quantize(kf, dtype), kv_quant.quantize(vf, dtype)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16, generator=g) * 3
    rows = torch.randperm(p, device="cuda", generator=g)[:b]
    lengths = torch.randint(1, s + 1, (b,), device="cuda", generator=g)
    lengths[0] = s
    return q, kq, vq, ks, vs, table, rows, lengths


def _rope_pages(fmt, b, s, hq=32, hkv=8, d=128, bs=16):
    """A RoPE decode step's qkv, cos, sin [b, ...], a table over shuffled pages and 8-bit pools [k, v, k_scale,
    v_scale] of b + 1 rows of s positions."""
    from .test_cuda import _rope_inputs

    qkv, cos, sin, kp, vp = _rope_inputs(b, hq, hkv, d, s)
    p = kp.shape[0]
    table = torch.randperm(p * s // bs, device="cuda").view(p, s // bs)
    (kq, ks), (vq, vs) = (kv_quant.quantize(x.view(p, hkv, s // bs, bs, d).transpose(1, 2).reshape(-1, hkv, bs, d),
                                            kv_quant.KV_DTYPES[fmt]) for x in (kp, vp))
    return qkv, cos, sin, table, [kq, vq, ks, vs]


def _q8(args, native, invariant=False):
    from onecopy import kernels

    return kernels.paged_decode_attention_q8(*args, invariant, native=native)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("b,hq,hkv,d,s", [(1, 32, 8, 128, 4096), (5, 6, 2, 64, 704), (70, 32, 8, 128, 1024),
                                          (16, 28, 4, 128, 2048), (3, 8, 8, 64, 256),
                                          (130, 16, 8, 128, 4096)])
def test_native_equals_triton_within_rounding(fmt, b, hq, hkv, d, s):
    """The last shape gives each warp 64 steps of one split: page ids read four groups ahead of their loads."""
    from onecopy.kernels import native

    args = _inputs(fmt, b, hq, hkv, d, s)
    got, want = _q8(args, True), _q8(args, False)
    assert native.loaded()
    assert torch.isfinite(got).all()
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < 4e-3, err  # each within ~2e-3 of float64 (bf16 output rounding: 2^-9)


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_invariant_rows_equal_their_solo_runs_bit_for_bit(fmt):
    """The batch-invariant decode splits a row by its length alone: a row's output is the same bits among 69
    others (where the default decode runs one split per row) as alone."""
    args = _inputs(fmt, 70, 32, 8, 128, 1024)
    q, kq, vq, ks, vs, table, rows, lengths = args
    batched = _q8(args, True, invariant=True)
    for i in (0, 13, 69):
        solo = _q8((q[i:i + 1], kq, vq, ks, vs, table, rows[i:i + 1], lengths[i:i + 1]), True, invariant=True)
        assert torch.equal(solo[0], batched[i]), i


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_reads_nothing_past_a_rows_length(fmt):
    """Positions past a row's length in its last page (and pages past it) hold anything, fp8 NaN codes too:
    the output is the same bits as with zeros there."""
    q, kq, vq, ks, vs, table, rows, lengths = _inputs(fmt, 9, 32, 8, 128, 512)
    lengths[1:] = torch.tensor([1, 15, 17, 33, 100, 255, 257, 511], device="cuda")
    clean = _q8((q, kq, vq, ks, vs, table, rows, lengths), True)
    kd, vd, ksd, vsd = kq.clone(), vq.clone(), ks.clone(), vs.clone()
    for i, r in enumerate(rows.tolist()):
        n = int(lengths[i])
        for pos in range(n, 512):
            page, off = int(table[r, pos // 16]), pos % 16
            kd[page, :, off].view(torch.uint8).fill_(0x7F)  # NaN in e4m3, 127 in int8
            vd[page, :, off].view(torch.uint8).fill_(0x7F)
            ksd[page, :, off] = float("nan")
            vsd[page, :, off] = float("inf")
    dirty = _q8((q, kd, vd, ksd, vsd, table, rows, lengths), True)
    assert torch.equal(clean, dirty)


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_rope_kernel_in_a_graph_replays_eager_bits(fmt):
    """The RoPE + quantizing-write kernel captured in a CUDA graph: the same output and cache bytes as eager."""
    from onecopy import kernels

    b = 6
    qkv, cos, sin, table, pools = _rope_pages(fmt, b, 1024)
    rows = torch.arange(b, device="cuda")
    pos = torch.tensor([0, 15, 16, 200, 777, 1023], device="cuda")
    eager_pools = [t.clone() for t in pools]
    want = kernels.paged_decode_attention_rope_q8(qkv, cos, sin, *eager_pools, table, rows, pos, native=True)
    graph_pools = [t.clone() for t in pools]
    static = [t.clone() for t in pools]
    kernels.paged_decode_attention_rope_q8(qkv, cos, sin, *static, table, rows, pos, native=True)  # warm up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kernels.paged_decode_attention_rope_q8(qkv, cos, sin, *static, table, rows, pos, native=True)
    for t, src in zip(static, graph_pools):
        t.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    for a, e in zip(static, eager_pools):
        assert torch.equal(a.view(torch.uint8), e.view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_takes_q_at_any_alignment(fmt):
    """The kernel reads q (and a RoPE step's qkv, cos, sin) 16 bytes at a time: a view one element off that
    alignment is copied first, and gives the bits of the aligned tensor."""
    from onecopy import kernels

    args = _inputs(fmt, 5, 32, 8, 128, 512)
    q = args[0]
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
    shifted.copy_(q)
    assert shifted.data_ptr() % 16 != 0
    assert torch.equal(_q8((shifted, *args[1:]), True), _q8(args, True))

    b = 3
    qkv, cos, sin, table, pools = _rope_pages(fmt, b, 256)
    rows, pos = torch.arange(b, device="cuda"), torch.tensor([5, 100, 255], device="cuda")
    outs = []
    for off in (0, 3):
        moved = [torch.empty(t.numel() + off, dtype=t.dtype, device="cuda")[off:].view(t.shape) for t in (qkv, cos, sin)]
        for m, t in zip(moved, (qkv, cos, sin)):
            m.copy_(t)
        state = [t.clone() for t in pools]
        outs.append((kernels.paged_decode_attention_rope_q8(*moved, *state, table, rows, pos, native=True), state))
    assert torch.equal(outs[0][0], outs[1][0])
    for a, e in zip(outs[0][1], outs[1][1]):
        assert torch.equal(a.view(torch.uint8), e.view(torch.uint8))
