"""The Triton source of `moe`'s routed-expert kernels (imported on their first launch: it imports Triton)."""

import triton
import triton.language as tl


@triton.jit
def _run(order, run_start, run_count, run_expert, s, BM: tl.constexpr, TOPK: tl.constexpr):
    """Block program_id(2) of BM pairs of run ``s`` (the routed pairs sorted by expert): whether the block holds any,
    the run's expert, the block's pairs' ids and their rows (token = pair // k)."""
    cnt = tl.load(run_count + s)
    e = tl.load(run_expert + s).to(tl.int64)
    c = tl.program_id(2) * BM + tl.arange(0, BM)
    cm = c < cnt
    pairs = tl.load(order + tl.load(run_start + s) + c, mask=cm, other=0).to(tl.int64)
    return tl.program_id(2) * BM < cnt, e, pairs, pairs // TOPK, cm


@triton.jit
def moe_gate_up_kernel(x, w, order, run_start, run_count, run_expert, h, stride_x, stride_e, stride_h,
                       D: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr,
                       BI: tl.constexpr, BD: tl.constexpr):
    """h[pair] = silu(x[token] W_gate^T) * (x[token] W_up^T) for the pairs of run program_id(0) (one expert: its
    [2 I, D] weight read once for each block of BM of them), outputs program_id(1) * BI ..."""
    s = tl.program_id(0)
    some, e, pairs, rows, cm = _run(order, run_start, run_count, run_expert, s, BM, TOPK)
    if some:
        i = tl.program_id(1) * BI + tl.arange(0, BI)
        im = i < INTER
        acc_g = tl.zeros((BM, BI), dtype=tl.float32)
        acc_u = tl.zeros((BM, BI), dtype=tl.float32)
        we = w + e * stride_e
        for d0 in range(0, D, BD):
            d = d0 + tl.arange(0, BD)
            dm = d < D
            xs = tl.load(x + rows[:, None] * stride_x + d[None, :], mask=cm[:, None] & dm[None, :], other=0.0)
            wm = im[:, None] & dm[None, :]
            wg = tl.load(we + i[:, None] * D + d[None, :], mask=wm, other=0.0)
            wu = tl.load(we + (INTER + i)[:, None] * D + d[None, :], mask=wm, other=0.0)
            acc_g = tl.dot(xs, tl.trans(wg), acc_g)
            acc_u = tl.dot(xs, tl.trans(wu), acc_u)
        DT = h.dtype.element_ty
        g = acc_g.to(DT).to(tl.float32)  # the eager step's rounding points: the products, silu, their product
        u = acc_u.to(DT).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(DT).to(tl.float32) * u
        tl.store(h + pairs[:, None] * stride_h + i[None, :], act.to(DT), mask=cm[:, None] & im[None, :])


@triton.jit
def moe_down_kernel(h, w, order, run_start, run_count, run_expert, y, stride_h, stride_e, stride_y,
                    D: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr, BM: tl.constexpr,
                    BO: tl.constexpr, BI: tl.constexpr):
    """y[pair] = h[pair] W_down^T for the pairs of run program_id(0) (its expert's [D, I] weight read once for each
    block of BM of them), outputs program_id(1) * BO ..."""
    s = tl.program_id(0)
    some, e, pairs, rows, cm = _run(order, run_start, run_count, run_expert, s, BM, TOPK)
    if some:
        o = tl.program_id(1) * BO + tl.arange(0, BO)
        om = o < D
        acc = tl.zeros((BM, BO), dtype=tl.float32)
        we = w + e * stride_e
        for i0 in range(0, INTER, BI):
            i = i0 + tl.arange(0, BI)
            im = i < INTER
            hs = tl.load(h + pairs[:, None] * stride_h + i[None, :], mask=cm[:, None] & im[None, :], other=0.0)
            wd = tl.load(we + o[:, None] * INTER + i[None, :], mask=om[:, None] & im[None, :], other=0.0)
            acc = tl.dot(hs, tl.trans(wd), acc)
        tl.store(y + pairs[:, None] * stride_y + o[None, :], acc.to(y.dtype.element_ty), mask=cm[:, None] & om[None, :])
