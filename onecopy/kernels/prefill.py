"""Prefill attention: a prefill chunk's queries against its session's row of the KV pool, causal by position.

Flash attention over the pool row in place: no copy of the row, no mask tensor, and key blocks past
a query block's last position are never visited, so a fresh prompt costs half a full attention.
On CPU the exported methods use `attention.chunk_attention` instead. `paged_prefill_attention`
(`launch_prefill_paged`) reads a paged cache (pages of BS positions, a block table row per session)
through the same kernel, the bits unchanged. The ops are defined in `ops`;
the tiles per head size are `tiles.PREFILL_TILES`. A batched prefill (equal-length chunks of several
sessions) is one launch with the chunks along the grid's third dimension.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _prefill_kernel():
    import triton
    import triton.language as tl

    # TABLE and stride_t after the old arguments: the non-paged kernel compiles to the same code as before.
    @triton.jit
    def prefill_kernel(Q, K, V, ROWS, POS, OUT, T,
                       stride_qt, stride_qh, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
                       stride_ot, stride_oh, TABLE, stride_t,
                       G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       QK_SCALE: tl.constexpr, PAGED: tl.constexpr, BS: tl.constexpr, KS, VS, stride_sp, stride_sh,
                       QUANT: tl.constexpr, stride_qb, stride_pb, stride_ob):
        # QUANT: an 8-bit paged cache (models.kv_quant), a float32 scale per position and head in KS/VS
        # [NB, Hkv, BS]; values convert exactly to q's dtype, the K scale multiplies the scores and the V
        # scale the probabilities (those times V in bf16 whatever q's dtype: scaled, fp16 probabilities
        # underflow). QUANT False compiles to the code from before 8-bit caches.
        mb = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) query blocks start first
        h = tl.program_id(1)
        b = tl.program_id(2)  # a batched prefill: chunk b of equal-length chunks, each on its own row
        row = tl.load(ROWS + b)
        Q += b * stride_qb
        POS += b * stride_pb
        OUT += b * stride_ob
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = offs_m < T
        pos = tl.load(POS + offs_m, mask=mmask, other=0)
        first = tl.load(POS + mb * BLOCK_M)  # chunk positions increase: the block's smallest and largest
        last = tl.load(POS + tl.minimum(mb * BLOCK_M + BLOCK_M, T) - 1)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mmask[:, None],
                    other=0.0)
        if PAGED:  # K/V are [NB, Hkv, BS, D] pages; position p of the row is in page TABLE[row, p // BS]
            k_base = K + (h // G) * stride_kh
            v_base = V + (h // G) * stride_vh
            tab = TABLE + row * stride_t
            if QUANT:
                ks_base = KS + (h // G) * stride_sh
                vs_base = VS + (h // G) * stride_sh
        else:
            k_base = K + row * stride_kp + (h // G) * stride_kh
            v_base = V + row * stride_vp + (h // G) * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # Keys up to `first` are visible to every query of the block: whole blocks of them need no mask.
        unmasked_end = (first + 1) // BLOCK_N * BLOCK_N
        for n in range(0, unmasked_end, BLOCK_N):
            offs_n = n + tl.arange(0, BLOCK_N)
            if PAGED:  # a page per position: a block may span pages
                blk = tl.load(tab + offs_n // BS)
                k = tl.load(k_base + (blk * stride_kp + (offs_n % BS) * stride_ks)[:, None] + offs_d[None, :])
            else:
                k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :])
            if QUANT:
                s = tl.dot(q, tl.trans(k.to(q.dtype))) * QK_SCALE
                s = s * tl.load(ks_base + blk * stride_sp + offs_n % BS)[None, :]
            else:
                s = tl.dot(q, tl.trans(k)) * QK_SCALE
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if PAGED:
                v = tl.load(v_base + (blk * stride_vp + (offs_n % BS) * stride_vs)[:, None] + offs_d[None, :])
            else:
                v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :])
            if QUANT:
                pv = p * tl.load(vs_base + blk * stride_sp + offs_n % BS)[None, :]
                acc = acc * alpha[:, None] + tl.dot(pv.to(tl.bfloat16), v.to(tl.bfloat16))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        for n in range(unmasked_end, last + 1, BLOCK_N):  # the diagonal: key j visible to query i iff j <= pos[i]
            offs_n = n + tl.arange(0, BLOCK_N)
            nmask = offs_n <= last
            if PAGED:  # masked positions look up page 0, unread
                blk = tl.load(tab + offs_n // BS, mask=nmask, other=0)
                k = tl.load(k_base + (blk * stride_kp + (offs_n % BS) * stride_ks)[:, None] + offs_d[None, :],
                            mask=nmask[:, None], other=0.0)
            else:
                k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=nmask[:, None], other=0.0)
            if QUANT:
                s = tl.dot(q, tl.trans(k.to(q.dtype))) * QK_SCALE
                s = s * tl.load(ks_base + blk * stride_sp + offs_n % BS, mask=nmask, other=0.0)[None, :]
            else:
                s = tl.dot(q, tl.trans(k)) * QK_SCALE
            s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every query sees key 0, so some block came before
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if PAGED:
                v = tl.load(v_base + (blk * stride_vp + (offs_n % BS) * stride_vs)[:, None] + offs_d[None, :],
                            mask=nmask[:, None], other=0.0)
            else:
                v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=nmask[:, None], other=0.0)
            if QUANT:
                pv = p * tl.load(vs_base + blk * stride_sp + offs_n % BS, mask=nmask, other=0.0)[None, :]
                acc = acc * alpha[:, None] + tl.dot(pv.to(tl.bfloat16), v.to(tl.bfloat16))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(OUT + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=mmask[:, None])

    return prefill_kernel


def launch_prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                   positions: torch.Tensor, tiles: tuple[int, int, int, int]) -> torch.Tensor:
    """One launch of the prefill kernel with the given (BLOCK_M, BLOCK_N, warps, stages): what the op
    runs with `prefill_tiles`, and what benchmarks/prefill_attention_cuda.py times with other tiles.
    q [T, Hq, D] at ``positions`` [T] against row rows[0]; or a batched prefill's q [B, T, Hq, D] at
    ``positions`` [B, T] (unit stride along T), chunk b against row rows[b], each chunk's bits those of its
    launch alone (a program reads one chunk's queries and one row). Traceable inside the op (wrap_triton);
    a plain launch outside it."""
    return _launch(q, k_pool, v_pool, None, rows, positions, tiles)


def launch_prefill_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                         rows: torch.Tensor, positions: torch.Tensor, tiles: tuple[int, int, int, int],
                         scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`launch_prefill` over a paged cache: pools [NB, Hkv, BS, D] and a block table [P, NBMAX] (int64,
    unit column stride) whose row rows[0] names the session's pages in order; bit for bit the non-paged
    result for the same logical row. ``scales`` (K's and V's, each [NB, Hkv, BS] float32, contiguous): the
    pools are an 8-bit cache (`models.kv_quant`), read dequantized."""
    return _launch(q, k_pool, v_pool, table, rows, positions, tiles, scales)


def _launch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor | None,
            rows: torch.Tensor, positions: torch.Tensor, tiles: tuple[int, int, int, int],
            scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    from torch.library import wrap_triton

    batched = q.dim() == 4  # q [B, T, Hq, D] (positions [B, T]) or one chunk's [T, Hq, D]
    batch = q.shape[0] if batched else 1
    t, hq, d = q.shape[-3:]
    block_m, block_n, warps, stages = tiles
    out = torch.empty_like(q)
    tab = table if table is not None else rows  # a placeholder the non-paged kernel never reads
    assert scales is None or table is not None, "an 8-bit KV cache is paged"
    ks, vs = scales if scales is not None else (q, q)  # placeholders too
    wrap_triton(_prefill_kernel())[((t + block_m - 1) // block_m, hq, batch)](
        q, k_pool, v_pool, rows, positions, out, t,
        q.stride(-3), q.stride(-2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), out.stride(-3), out.stride(-2), tab, tab.stride(0),
        G=hq // k_pool.shape[1], D=d, BLOCK_M=block_m, BLOCK_N=block_n, QK_SCALE=d ** -0.5 * 1.4426950408889634,
        PAGED=table is not None, BS=k_pool.shape[2] if table is not None else 1,
        KS=ks, VS=vs, stride_sp=ks.stride(0) if scales else 0, stride_sh=ks.stride(1) if scales else 0,
        QUANT=scales is not None, stride_qb=q.stride(0) if batched else 0,
        stride_pb=positions.stride(0) if batched else 0, stride_ob=out.stride(0) if batched else 0,
        num_warps=warps, num_stages=stages)
    return out
