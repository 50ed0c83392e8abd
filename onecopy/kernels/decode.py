"""Split-KV ("flash-decoding") decode attention: one query per session against its row of the KV pool.

`decode_attention`: reads only the filled prefix (``lengths``) of each row, in place, with all query
heads of a grouped-query group served by one program, so each K/V block is read once. A second
kernel merges the splits (over an 8-bit cache, none when each row has one: the split kernel then writes
the output). On CPU the exported methods use `attention.pooled_attention` instead.
`decode_attention_rope`: the same from a decode step's projected q/k/v rows, with RoPE on q and the
new k and the write of the new k/v into the pool done inside the split kernel (two kernels fewer per
layer): the program whose split holds the new position takes that key from registers, last, and
caches it; the others read only positions before it, so no program reads what another writes.
`paged_decode_attention` and `paged_decode_attention_rope`: the same kernels over a paged cache
(`launch_decode_paged`: pages of BS positions, a block table row per session), each position's page
looked up as it is read or written; same splits and reduction order, so the same bits.
The ops themselves are defined in `ops`; Triton is imported only when a kernel is first launched.
"""

from __future__ import annotations

import functools

import torch

from .tiles import BLOCK_N, BLOCK_N_Q8, DECODE_PROGRAMS, DECODE_PROGRAMS_Q8, SPLIT_MAX, decode_splits, merged_rows, n_splits


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # TABLE and stride_t come after the old arguments so that the non-paged kernel compiles to the same code
    # as before they existed (one unused parameter more).
    @triton.jit
    def split_kernel(Q, K, V, ROWS, LENS, PO, PML, COS, SIN,
                     stride_qb, stride_qh, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
                     stride_pob, stride_poh, stride_pos, stride_pmb, stride_pmh, stride_pms, stride_cb, TABLE, stride_t,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, NS: tl.constexpr,
                     SCALE: tl.constexpr, NEW: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                     PAGED: tl.constexpr, BS: tl.constexpr, KS, VS, stride_sp, stride_sh, QMAX: tl.constexpr, NSE,
                     OUT, stride_ob, stride_oh):
        # QMAX > 0: an 8-bit cache (models.kv_quant; 127 int8, 448 fp8) with a float32 scale per position and
        # head in KS/VS [NB, Hkv, BS]: values convert exactly to q's dtype, the K scale multiplies the scores
        # and the V scale the probabilities (those times V in bf16 whatever q's dtype: scaled, fp16 probabilities
        # underflow). QMAX = 0 compiles to the code from before 8-bit caches. NSE: the splits launched (<= NS, the
        # partial buffers' size; `tiles.decode_splits`); with one over an 8-bit cache, this program's result is
        # the output (OUT) and no merge runs (`tiles.merged_rows`).
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        row = tl.load(ROWS + b)
        length = tl.load(LENS + b)
        split = tl.cdiv(tl.cdiv(length, NSE), BLOCK) * BLOCK  # this row's positions per program
        start = sp * split
        end = tl.minimum(start + split, length)  # empty (start >= end) for the splits past the length
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        gmask = offs_g < G
        heads = kvh * G + offs_g
        if PAGED:  # K/V are [NB, Hkv, BS, D] pages; position p of the row is in page TABLE[row, p // BS]
            k_base = K + kvh * stride_kh
            v_base = V + kvh * stride_vh
            tab = TABLE + row * stride_t
            if QMAX > 0:
                ks_base = KS + kvh * stride_sh
                vs_base = VS + kvh * stride_sh
        else:
            k_base = K + row * stride_kp + kvh * stride_kh
            v_base = V + row * stride_vp + kvh * stride_vh
        if NEW:  # Q is the step's projected q/k/v row: RoPE on q and the new k here, the new k/v not yet cached
            cur = length - 1
            rot = (offs_d + D // 2) % D  # rotate_half: (-x2, x1)
            sign = tl.where(offs_d < D // 2, -1.0, 1.0)
            c = tl.load(COS + b * stride_cb + offs_d).to(tl.float32)
            s_ = tl.load(SIN + b * stride_cb + offs_d).to(tl.float32) * sign
            qb = Q + b * stride_qb
            q = tl.load(qb + heads[:, None] * D + offs_d[None, :], mask=gmask[:, None], other=0.0)
            qr = tl.load(qb + heads[:, None] * D + rot[None, :], mask=gmask[:, None], other=0.0)
            q = (q.to(tl.float32) * c[None, :] + qr.to(tl.float32) * s_[None, :]).to(q.dtype)
            own = (start <= cur) & (cur < end)  # the one program whose split holds the new position
            kn = tl.load(qb + (HQ + kvh) * D + offs_d, mask=own & (offs_d < D), other=0.0)
            knr = tl.load(qb + (HQ + kvh) * D + rot, mask=own & (offs_d < D), other=0.0)
            k_new = (kn.to(tl.float32) * c + knr.to(tl.float32) * s_).to(kn.dtype)
            v_new = tl.load(qb + (HQ + HKV + kvh) * D + offs_d, mask=own & (offs_d < D), other=0.0)
            end = tl.minimum(end, cur)  # the pool holds positions < cur; the new one comes from registers
        else:
            q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for n in range(start, end, BLOCK):
            offs_n = n + tl.arange(0, BLOCK)
            nmask = offs_n < end
            if PAGED:  # a page per position (a block may span pages); masked positions look up page 0, unread
                blk = tl.load(tab + offs_n // BS, mask=nmask, other=0)
                k = tl.load(k_base + (blk * stride_kp + (offs_n % BS) * stride_ks)[:, None] + offs_d[None, :],
                            mask=nmask[:, None], other=0.0)
            else:
                k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=nmask[:, None], other=0.0)
            if QMAX > 0:
                s = tl.dot(q, tl.trans(k.to(q.dtype))) * SCALE
                s = s * tl.load(ks_base + blk * stride_sp + offs_n % BS, mask=nmask, other=0.0)[None, :]
            else:
                s = tl.dot(q, tl.trans(k)) * SCALE
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if PAGED:
                v = tl.load(v_base + (blk * stride_vp + (offs_n % BS) * stride_vs)[:, None] + offs_d[None, :],
                            mask=nmask[:, None], other=0.0)
            else:
                v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=nmask[:, None], other=0.0)
            if QMAX > 0:
                pv = p * tl.load(vs_base + blk * stride_sp + offs_n % BS, mask=nmask, other=0.0)[None, :]
                acc = acc * alpha[:, None] + tl.dot(pv.to(tl.bfloat16), v.to(tl.bfloat16))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if NEW:
            if QMAX > 0:  # constexpr first: with QMAX = 0 nothing below is compiled
                if own:  # the same with the new k/v quantized first: what later steps will read
                    kf, vf = k_new.to(tl.float32), v_new.to(tl.float32)
                    k_sc = tl.maximum(tl.max(tl.abs(kf), 0), 1e-30) / QMAX
                    v_sc = tl.maximum(tl.max(tl.abs(vf), 0), 1e-30) / QMAX
                    yk, yv = kf / k_sc, vf / v_sc
                    if QMAX == 127.0:  # int8: round half to even (adding 1.5 * 2**23 drops the fraction so), clamp
                        yk = tl.minimum(tl.maximum((yk + 12582912.0) - 12582912.0, -127.0), 127.0)
                        yv = tl.minimum(tl.maximum((yv + 12582912.0) - 12582912.0, -127.0), 127.0)
                    k_q, v_q = yk.to(K.dtype.element_ty), yv.to(V.dtype.element_ty)  # fp8: round to nearest even
                    s_new = tl.sum(q.to(tl.float32) * k_q.to(tl.float32)[None, :], 1) * SCALE * k_sc
                    m_new = tl.maximum(m_i, s_new)
                    alpha = tl.exp(m_i - m_new)
                    p = tl.exp(s_new - m_new)
                    l_i = l_i * alpha + p
                    pv = (p * v_sc).to(tl.bfloat16).to(tl.float32)
                    acc = acc * alpha[:, None] + pv[:, None] * v_q.to(tl.float32)[None, :]
                    m_i = m_new
                    blk_cur = tl.load(tab + cur // BS)
                    tl.store(k_base + blk_cur * stride_kp + (cur % BS) * stride_ks + offs_d, k_q)
                    tl.store(v_base + blk_cur * stride_vp + (cur % BS) * stride_vs + offs_d, v_q)
                    tl.store(ks_base + blk_cur * stride_sp + cur % BS, k_sc)
                    tl.store(vs_base + blk_cur * stride_sp + cur % BS, v_sc)
            elif own:  # the new key last, as the loop would have taken it; then it is cached
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * SCALE
                m_new = tl.maximum(m_i, s_new)
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s_new - m_new)
                l_i = l_i * alpha + p
                acc = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
                m_i = m_new
                if PAGED:
                    blk_cur = tl.load(tab + cur // BS)
                    tl.store(k_base + blk_cur * stride_kp + (cur % BS) * stride_ks + offs_d, k_new)
                    tl.store(v_base + blk_cur * stride_vp + (cur % BS) * stride_vs + offs_d, v_new)
                else:
                    tl.store(k_base + cur * stride_ks + offs_d, k_new)
                    tl.store(v_base + cur * stride_vs + offs_d, v_new)
        direct = False  # 8-bit caches only (`tiles.merged_rows` says why): one split writes the output itself
        if QMAX > 0:  # constexpr: with QMAX = 0, `direct` stays a constant and the store below is the only one
            direct = NSE == 1
        if direct:  # the merge's arithmetic for one split (weight exp(0) = 1): acc / l, the same bits
            tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     (acc / l_i[:, None]).to(OUT.dtype.element_ty), mask=gmask[:, None])
        else:
            tl.store(PO + b * stride_pob + heads[:, None] * stride_poh + sp * stride_pos + offs_d[None, :], acc,
                     mask=gmask[:, None])
            pml = PML + b * stride_pmb + heads * stride_pmh + sp * stride_pms
            tl.store(pml, m_i, mask=gmask)
            tl.store(pml + 1, l_i, mask=gmask)

    @triton.jit
    def merge_kernel(PO, PML, OUT, stride_pob, stride_poh, stride_pos, stride_pmb, stride_pmh, stride_pms,
                     stride_ob, stride_oh, NS: tl.constexpr, NSP: tl.constexpr, D: tl.constexpr, NSE):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, NSP)
        offs_d = tl.arange(0, D)
        smask = offs_s < NSE  # the splits launched
        pml = PML + b * stride_pmb + h * stride_pmh + offs_s * stride_pms
        m = tl.load(pml, mask=smask, other=float("-inf"))
        l = tl.load(pml + 1, mask=smask, other=0.0)
        w = tl.where(smask, tl.exp(m - tl.max(m, 0)), 0.0)  # empty splits have m = -inf: weight 0
        o = tl.load(PO + b * stride_pob + h * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :],
                    mask=smask[:, None], other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.sum(w * l, 0)
        tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))

    return split_kernel, merge_kernel


def launch_decode(q: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, k_pool: torch.Tensor,
                  v_pool: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """The split and merge launches of `decode_attention` (``rope`` None: q [B, Hq, D]) or of
    `decode_attention_rope` (``rope`` = (cos, sin): q is the qkv rows). ``invariant``: the splits of a row
    depend on its length alone, never on the batch (`tiles.decode_splits`). Traceable inside the ops."""
    return _launch(q, rope, k_pool, v_pool, None, rows, lengths, invariant=invariant)


def launch_decode_paged(q: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, k_pool: torch.Tensor,
                        v_pool: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                        lengths: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                        tiles: tuple[int, int, int, int] | None = None, invariant: bool = False) -> torch.Tensor:
    """`launch_decode` over a paged cache: pools [NB, Hkv, BS, D] and a block table [P, NBMAX] (int64,
    unit column stride) whose row rows[b] names the pages of session b in order. The splits are those of a
    pool of NBMAX * BS positions, so that the result is bit for bit the non-paged one's for the same
    logical rows. ``scales`` (K's and V's, each [NB, Hkv, BS] float32, contiguous): the pools are an 8-bit
    cache (`models.kv_quant`), read dequantized and, with ``rope``, written quantized. ``tiles``: (positions
    per split at most, BLOCK, warps, stages) instead of the table's (benchmarks/kv_attention_cuda.py --sweep).
    Traceable inside the ops."""
    return _launch(q, rope, k_pool, v_pool, table, rows, lengths, scales, tiles, invariant)


def _launch(q: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, k_pool: torch.Tensor,
            v_pool: torch.Tensor, table: torch.Tensor | None, rows: torch.Tensor,
            lengths: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
            tiles: tuple[int, int, int, int] | None = None, invariant: bool = False) -> torch.Tensor:
    from torch.library import wrap_triton

    from ..models.kv_quant import QMAX

    split_kernel, merge_kernel = _kernels()
    hkv, s, d = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    bs = s
    if table is not None:
        s = table.shape[1] * bs  # the logical row: NBMAX pages of BS positions
    b = q.shape[0]
    hq = q.shape[1] // d - 2 * hkv if rope is not None else q.shape[1]
    g = hq // hkv
    split_max, block, warps, stages = tiles or (SPLIT_MAX, BLOCK_N_Q8 if scales else BLOCK_N, 4, 2)
    ns = n_splits(s, split_max, block)
    nse = ns if invariant or tiles else decode_splits(b, hkv, ns, DECODE_PROGRAMS_Q8 if scales else DECODE_PROGRAMS)
    po = torch.empty((b, hq, ns, d), dtype=torch.float32, device=q.device)
    pml = torch.empty((b, hq, ns, 2), dtype=torch.float32, device=q.device)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    cos, sin = rope if rope is not None else (q, q)  # placeholders the kernel never reads
    tab = table if table is not None else rows  # a placeholder too
    assert scales is None or table is not None, "an 8-bit KV cache is paged"
    ks, vs = scales if scales is not None else (q, q)  # placeholders too
    wrap_triton(split_kernel)[(b, hkv, nse)](
        q, k_pool, v_pool, rows, lengths, po, pml, cos, sin,
        q.stride(0), d if rope is not None else q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        po.stride(0), po.stride(1), po.stride(2), pml.stride(0), pml.stride(1), pml.stride(2), cos.stride(0),
        tab, tab.stride(0),
        G=g, GP=max(16, 1 << (g - 1).bit_length()), D=d, BLOCK=block, NS=ns, SCALE=d ** -0.5,
        NEW=rope is not None, HQ=hq, HKV=hkv, PAGED=table is not None, BS=bs if table is not None else 1,
        KS=ks, VS=vs, stride_sp=ks.stride(0) if scales else 0, stride_sh=ks.stride(1) if scales else 0,
        QMAX=QMAX[k_pool.dtype] if scales else 0.0, NSE=nse, OUT=out, stride_ob=out.stride(0),
        stride_oh=out.stride(1), num_warps=warps, num_stages=stages)
    merged = merged_rows(b, nse) if scales is not None else b  # none (no launch) when the split kernel wrote out
    wrap_triton(merge_kernel)[(merged, hq)](
        po, pml, out, po.stride(0), po.stride(1), po.stride(2), pml.stride(0), pml.stride(1), pml.stride(2),
        out.stride(0), out.stride(1), NS=ns, NSP=max(2, 1 << (ns - 1).bit_length()), D=d, NSE=nse, num_warps=4)
    return out
