"""Qwen3.5's DeltaNet decode step as one Triton kernel (`kernels.deltanet`) against float64 and the eager step."""

import pytest
import torch

from onecopy.models.attention import Step
from onecopy.models.qwen3_5_deltanet import GatedDeltaNet

from ..qwen35_layers import random_deltanet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# the tiny preset's heads (dk = dv = 16, 2 key / 4 value heads) and Qwen3.5-35B-A3B's (128, 16 / 32)
SHAPES = {"tiny": {}, "35b-a3b": dict(dim=512, linear_n_k_heads=16, linear_n_v_heads=32, linear_k_head_dim=128,
                                      linear_v_head_dim=128)}


def _layer(shape: str) -> GatedDeltaNet:
    return random_deltanet(**SHAPES[shape])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_deltanet_decode_kernel_matches_float64_and_the_eager_step(shape):
    """Five sessions' decode step (two at position 0: from zero state) through the kernel on CUDA (bf16) against
    the same step in float64 and the eager bf16 step (both on the CPU, where no kernel runs): the conv window shifted
    by the new input bit for bit, the output and the recurrent state are as close to float64
    as the eager step's (within 1.25x its mean error and 2x its largest); each row's bits do not depend on the rows
    beside it, and a CUDA graph replays the kernel bit for bit."""
    m = _layer(shape)
    pool, rows, pos = 8, torch.tensor([6, 1, 3, 0, 5]), torch.tensor([9, 0, 4, 0, 2])
    conv = torch.randn(pool, m.conv_dim, m.kernel).to(torch.bfloat16)
    rec = torch.randn(pool, m.nv, m.dk, m.dv) * 0.5
    x = torch.randn(len(rows), 1, m.in_proj.in_features).to(torch.bfloat16)

    def run(module, device, dtype, x_, rows_, pos_):
        c, r = conv.to(device, dtype).clone(), rec.to(device, torch.float64 if dtype == torch.float64 else
                                                          torch.float32).clone()
        with torch.no_grad():
            out = module.to(device, dtype)(x_.to(device, dtype), Step(rows_.to(device), pos_.to(device), True), c, r, 1)
        return out, c, r

    ref = run(_layer(shape), "cpu", torch.float64, x, rows, pos)
    eager = run(_layer(shape), "cpu", torch.bfloat16, x, rows, pos)
    m = m.to("cuda", torch.bfloat16)
    got = run(m, "cuda", torch.bfloat16, x, rows, pos)
    # the conv window shifted by one input, the new one the input projection's (cuBLAS here, not the CPU's GEMM)
    with torch.no_grad():
        new = m.in_proj(x.cuda())[:, 0, :m.conv_dim].cpu()
    old = torch.where((pos == 0)[:, None, None], torch.zeros_like(conv[rows]), conv[rows])
    want = conv.clone()
    want[rows] = torch.cat([old[..., 1:], new[..., None]], dim=-1)
    assert torch.equal(got[1].cpu(), want)
    for i in (0, 2):  # output, recurrent state
        e = (eager[i].double() - ref[i]).abs()
        g = (got[i].cpu().double() - ref[i]).abs()
        assert g.mean() <= 1.25 * e.mean() and g.max() <= 2 * e.max(), (shape, i, g.mean(), e.mean(), g.max(), e.max())
    for lo, hi in ((0, 1), (2, 5), (1, 3)):  # rows alone or beside others: the same bits
        part = run(m, "cuda", torch.bfloat16, x[lo:hi], rows[lo:hi], pos[lo:hi])
        assert torch.equal(part[0], got[0][lo:hi]), (shape, lo, hi)
        assert torch.equal(part[2][rows[lo:hi]], got[2][rows[lo:hi]]), (shape, lo, hi)
    c, r = conv.cuda().clone(), rec.cuda().clone()
    xs, step = x.cuda(), Step(rows.cuda(), pos.cuda(), True)
    with torch.no_grad():
        m(xs, step, c.clone(), r.clone(), 1)  # warm up (the kernel's first launch compiles it)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m(xs, step, c, r, 1)
        c.copy_(conv.cuda()), r.copy_(rec.cuda())
        graph.replay()
    assert torch.equal(out, got[0]) and torch.equal(c, got[1]) and torch.equal(r, got[2]), shape


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("t", [1, 64, 150])
def test_prefill_chunk_scan_kernel_matches_float64_and_the_eager_prefill(shape, t):
    """A prefill of T tokens from a session's held state (conv window and recurrent state) on CUDA, where the chunk
    recurrence is one kernel (`kernels.deltanet_chunk_scan`, transformers' chunks of ``linear_chunk_size``), against
    the same prefill in float64 and the eager float32 one on the CPU (the chunk loop in torch ops): output, conv
    window and state within the eager prefill's own error of float64 (1.25x its mean, 2x its largest); bundles take
    the same path (tests/gpu/test_qwen3_5_cuda.py)."""
    m = _layer(shape)
    assert m.chunk_scan
    conv = torch.randn(2, m.conv_dim, m.kernel)
    rec = torch.randn(2, m.nv, m.dk, m.dv) * 0.5
    x = torch.randn(1, t, m.in_proj.in_features)

    def run(device, dtype):
        layer = _layer(shape).to(device, dtype)
        c, r = conv.to(device, dtype).clone(), rec.to(device, torch.float64 if dtype == torch.float64 else
                                                         torch.float32).clone()
        step = Step(torch.tensor([1], device=device), torch.arange(5, 5 + t, device=device), False)
        with torch.no_grad():
            out = layer(x.to(device, dtype), step, c, r, 4)
        return out, c, r

    ref, eager = run("cpu", torch.float64), run("cpu", torch.float32)
    got = run("cuda", torch.float32)
    for i in range(3):  # output, conv window, recurrent state
        e = (eager[i].double() - ref[i]).abs()
        g = (got[i].cpu().double() - ref[i]).abs()
        assert g.mean() <= 1.25 * e.mean() + 1e-6 and g.max() <= 2 * e.max() + 1e-6, (shape, t, i, g.mean(),
                                                                                      e.mean(), g.max(), e.max())
