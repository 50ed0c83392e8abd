"""Triton kernels the exported CUDA methods call, registered as torch ops so AOTInductor embeds them.

`decode_attention`: one query per session against that session's row of the KV pool, reading only
the filled prefix (``lengths``) in place: split-KV ("flash-decoding") with all query heads of a
grouped-query group served by one program, so each K/V block is read once. A second kernel merges
the splits. On CPU the exported methods use `attention.pooled_attention` instead.
`decode_attention_rope`: the same from a decode step's projected q/k/v rows, with RoPE on q and the
new k and the write of the new k/v into the pool done inside the split kernel (two kernels fewer per
layer): the program whose split holds the new position takes that key from registers, last, and
caches it; the others read only positions before it, so no program reads what another writes.

`prefill_attention`: a prefill chunk's queries against its session's row, causal by position, in
place (flash attention over the pool row: no copy of the row, no mask tensor, and key blocks past a
query block's last position are never visited, so a fresh prompt costs half a full attention).
On CPU the exported methods use `attention.chunk_attention` instead.

`small_linear`: ``x @ weight.T`` for a decode step's rows, one program per `BLOCK_N` output features and
block of rows (`SMALL_LINEAR_ROWS`; `INVARIANT_ROWS` in the batch-invariant decode past that many)
streaming their weight rows once, with the elementwise
work after it folded in: SwiGLU of a fused gate/up weight (``glu``) or a residual add, and the
RMSNorm before it. A norm needs its row's sum of squares before any program can start, and every
program redoing that reduction cost more than a separate norm kernel on the H200; so each kernel also
writes its programs' partial sums of squares of its output rows, and the next kernel's programs add
up those few floats (one kernel fewer per norm, nothing re-read). cuBLAS splits such a skinny product over K and reduces in a second
kernel; this reads each weight once, in one kernel, at close to the copy bandwidth
(benchmarks/gemv_cuda.py). Wider batches keep cuBLAS (`projections.by_rows` picks per call).
"""

from __future__ import annotations

import functools

import torch

BLOCK_N = 64  # cache positions per inner step
# The grid has one program per (row, KV head) and SPLIT_MAX cache positions of the pool (fewer when
# the cache is shorter); each row's filled prefix is shared evenly among them in whole blocks, so a
# short context is still spread over many programs (batch 1, 1k context in a 16k pool: 16 programs of
# one block per head instead of 4 of four). A row's split depends only on its own length.
SPLIT_MAX = 256
# Prefill tiles: (query rows, key columns, warps, pipeline stages) per program, by head size.
# The fastest over a fresh 1k, a fresh 8k and a 2k-after-6k chunk on the H200
# (benchmarks/prefill_attention_cuda.py, benchmarks/results/prefill_attention_h200.json).
PREFILL_TILES = {64: (64, 64, 4, 3), 128: (64, 64, 4, 3), 256: (64, 32, 4, 2)}
# small_linear: the rows one program serves (the tensor-core tile's height). A call takes any number of
# rows, a block of this many per program, each row's arithmetic the same wherever it sits (batch
# invariance); the default decode sends more than this many rows to cuBLAS (`projections.by_rows`).
SMALL_LINEAR_ROWS = 16
# Rows per program past SMALL_LINEAR_ROWS in the batch-invariant decode (`invariant`). At 64 rows a program
# reads the 8B shape's weights as fast as cuBLAS (0.9-1.25x per projection, benchmarks/gemv_cuda.py
# --block-m 64, benchmarks/results/gemv_bm64_h200.json); programs of 16 rows re-read them (0.43-0.66x,
# gemv_rows16_h200.json), and so did four 16-row dots per program (gemv_sub4_h200.json).
# Up to SMALL_LINEAR_ROWS rows it keeps 16-row programs (faster for a few rows): a row gets the same bits
# from a 16-row and a 64-row tile with the same BLOCK_N and BLOCK_K (only its partial sums of squares
# differ: tests/gpu/test_cuda.py::test_small_linear_rows_are_independent_of_the_batch).
INVARIANT_ROWS = 64
SMEM_BUDGET = 200 * 1024  # bytes of shared memory the small-linear pipeline may take (H100/H200: 227 KiB)
# An RMSNorm folded into small_linear: (weight, partial sums of squares of each row [M, P], eps).
Norm = tuple[torch.Tensor, torch.Tensor, float]


def small_linear_tiles(n_out: int, glu: bool, invariant: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for ``n_out`` output features: the fastest on the H200 per
    Llama-3-8B projection (benchmarks/gemv_cuda.py). Few outputs want long K steps to keep enough bytes
    in flight per program; gate/up reads two tiles per step. 16 rows per program:
    benchmarks/results/gemv_h200.json; ``invariant`` (the batch-invariant decode, whose 16- and 64-row
    programs must share BLOCK_N and BLOCK_K so that a row's reduction order is one): the fastest with
    64 rows per program, benchmarks/results/gemv_bm64_h200.json."""
    if invariant:
        if glu:
            return (64, 128, 4, 4)
        if n_out <= 4096:
            return (32, 256, 4, 4)
        if n_out <= 8192:
            return (64, 256, 4, 3)
        return (128, 128, 4, 4)
    if glu:
        return (32, 128, 4, 3)
    if n_out <= 4096:
        return (32, 512, 4, 4)
    if n_out <= 8192:
        return (64, 256, 4, 4)
    return (64, 128, 4, 3)


def available() -> bool:
    """True when Triton and a CUDA device are usable in this process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def n_splits(max_seq_len: int) -> int:
    """Programs per (row, KV head): one per SPLIT_MAX positions of the cache (block-rounded when shorter)."""
    return -(-max_seq_len // min(SPLIT_MAX, -(-max_seq_len // BLOCK_N) * BLOCK_N))


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(Q, K, V, ROWS, LENS, PO, PML, COS, SIN,
                     stride_qb, stride_qh, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
                     stride_pob, stride_poh, stride_pos, stride_pmb, stride_pmh, stride_pms, stride_cb,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, NS: tl.constexpr,
                     SCALE: tl.constexpr, NEW: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        row = tl.load(ROWS + b)
        length = tl.load(LENS + b)
        split = tl.cdiv(tl.cdiv(length, NS), BLOCK) * BLOCK  # this row's positions per program
        start = sp * split
        end = tl.minimum(start + split, length)  # empty (start >= end) for the splits past the length
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, D)
        gmask = offs_g < G
        heads = kvh * G + offs_g
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
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * SCALE
            s = tl.where(nmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if NEW:
            if own:  # the new key last, as the loop would have taken it; then it is cached
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * SCALE
                m_new = tl.maximum(m_i, s_new)
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s_new - m_new)
                l_i = l_i * alpha + p
                acc = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
                m_i = m_new
                tl.store(k_base + cur * stride_ks + offs_d, k_new)
                tl.store(v_base + cur * stride_vs + offs_d, v_new)
        tl.store(PO + b * stride_pob + heads[:, None] * stride_poh + sp * stride_pos + offs_d[None, :], acc,
                 mask=gmask[:, None])
        pml = PML + b * stride_pmb + heads * stride_pmh + sp * stride_pms
        tl.store(pml, m_i, mask=gmask)
        tl.store(pml + 1, l_i, mask=gmask)

    @triton.jit
    def merge_kernel(PO, PML, OUT, stride_pob, stride_poh, stride_pos, stride_pmb, stride_pmh, stride_pms,
                     stride_ob, stride_oh, NS: tl.constexpr, NSP: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, NSP)
        offs_d = tl.arange(0, D)
        smask = offs_s < NS
        pml = PML + b * stride_pmb + h * stride_pmh + offs_s * stride_pms
        m = tl.load(pml, mask=smask, other=float("-inf"))
        l = tl.load(pml + 1, mask=smask, other=0.0)
        w = tl.where(smask, tl.exp(m - tl.max(m, 0)), 0.0)  # empty splits have m = -inf: weight 0
        o = tl.load(PO + b * stride_pob + h * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :],
                    mask=smask[:, None], other=0.0)
        out = tl.sum(o * w[:, None], 0) / tl.sum(w * l, 0)
        tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty))

    return split_kernel, merge_kernel


@functools.cache
def _prefill_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def prefill_kernel(Q, K, V, ROWS, POS, OUT, T,
                       stride_qt, stride_qh, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
                       stride_ot, stride_oh,
                       G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       QK_SCALE: tl.constexpr):
        mb = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) query blocks start first
        h = tl.program_id(1)
        row = tl.load(ROWS)
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = offs_m < T
        pos = tl.load(POS + offs_m, mask=mmask, other=0)
        first = tl.load(POS + mb * BLOCK_M)  # chunk positions increase: the block's smallest and largest
        last = tl.load(POS + tl.minimum(mb * BLOCK_M + BLOCK_M, T) - 1)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mmask[:, None],
                    other=0.0)
        k_base = K + row * stride_kp + (h // G) * stride_kh
        v_base = V + row * stride_vp + (h // G) * stride_vh
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # Keys up to `first` are visible to every query of the block: whole blocks of them need no mask.
        unmasked_end = (first + 1) // BLOCK_N * BLOCK_N
        for n in range(0, unmasked_end, BLOCK_N):
            offs_n = n + tl.arange(0, BLOCK_N)
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :])
            s = tl.dot(q, tl.trans(k)) * QK_SCALE
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        for n in range(unmasked_end, last + 1, BLOCK_N):  # the diagonal: key j visible to query i iff j <= pos[i]
            offs_n = n + tl.arange(0, BLOCK_N)
            nmask = offs_n <= last
            k = tl.load(k_base + offs_n[:, None] * stride_ks + offs_d[None, :], mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * QK_SCALE
            s = tl.where(offs_n[None, :] <= pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every query sees key 0, so some block came before
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * stride_vs + offs_d[None, :], mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(OUT + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=mmask[:, None])

    return prefill_kernel


@functools.cache
def _linear_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def linear_kernel(X, W, OUT, R, NW, SS, SS_OUT, M, N_OUT, K, P_IN, eps, stride_xm, stride_wn, stride_om, stride_rm,
                      stride_ssm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr,
                      RESIDUAL: tl.constexpr, NORM: tl.constexpr, P_POW2: tl.constexpr):
        mb = tl.program_id(0)  # row block: the fastest grid axis, so the blocks sharing a weight tile run together
        pid = tl.program_id(1)
        dtype = OUT.dtype.element_ty
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = offs_m < M
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N_OUT
        offs_k = tl.arange(0, BLOCK_K)
        if NORM:  # the row's sum of squares, from the partial sums of the kernel that produced x
            offs_p = tl.arange(0, P_POW2)
            ss = tl.load(SS + offs_m[:, None] * stride_ssm + offs_p[None, :], mask=mmask[:, None] & (offs_p < P_IN)[None, :],
                         other=0.0)
            rstd = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            kk = k + offs_k
            kmask = kk < K
            x = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            if NORM:  # the norm's weight on x here, its 1/rms on the sums below (off the loop's critical path)
                nw = tl.load(NW + kk, mask=kmask, other=0.0)
                x = x * nw[None, :]
            w = tl.load(W + offs_n[:, None] * stride_wn + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w))  # tensor cores even for one row: FMAs were 1.2-1.5x slower
            if GLU:  # the up projection's rows follow the gate's
                wu = tl.load(W + (offs_n + N_OUT)[:, None] * stride_wn + kk[None, :],
                             mask=nmask[:, None] & kmask[None, :], other=0.0)
                acc_up += tl.dot(x, tl.trans(wu))
        if NORM:
            acc = acc * rstd[:, None]
            acc_up = acc_up * rstd[:, None]
        y = acc.to(dtype)
        if GLU:  # silu(gate) * up, each rounded to the model dtype as the eager ops are
            g = y.to(tl.float32)
            y = ((g * tl.sigmoid(g)).to(dtype).to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
        omask = mmask[:, None] & nmask[None, :]
        if RESIDUAL:
            r = tl.load(R + offs_m[:, None] * stride_rm + offs_n[None, :], mask=omask, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
        tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=omask)
        # This program's share of each output row's sum of squares: the next RMSNorm adds them up.
        yf = tl.where(omask, y.to(tl.float32), 0.0)
        tl.store(SS_OUT + offs_m * tl.num_programs(1) + pid, tl.sum(yf * yf, axis=1), mask=mmask)

    return linear_kernel


def launch_decode(q: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, k_pool: torch.Tensor,
                  v_pool: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The split and merge launches of `decode_attention` (``rope`` None: q [B, Hq, D]) or of
    `decode_attention_rope` (``rope`` = (cos, sin): q is the qkv rows). Traceable inside the ops."""
    from torch.library import wrap_triton

    split_kernel, merge_kernel = _kernels()
    hkv, s, d = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    b = q.shape[0]
    hq = q.shape[1] // d - 2 * hkv if rope is not None else q.shape[1]
    g = hq // hkv
    ns = n_splits(s)
    po = torch.empty((b, hq, ns, d), dtype=torch.float32, device=q.device)
    pml = torch.empty((b, hq, ns, 2), dtype=torch.float32, device=q.device)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    cos, sin = rope if rope is not None else (q, q)  # placeholders the kernel never reads
    wrap_triton(split_kernel)[(b, hkv, ns)](
        q, k_pool, v_pool, rows, lengths, po, pml, cos, sin,
        q.stride(0), d if rope is not None else q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        po.stride(0), po.stride(1), po.stride(2), pml.stride(0), pml.stride(1), pml.stride(2), cos.stride(0),
        G=g, GP=max(16, 1 << (g - 1).bit_length()), D=d, BLOCK=BLOCK_N, NS=ns, SCALE=d ** -0.5,
        NEW=rope is not None, HQ=hq, HKV=hkv, num_warps=4, num_stages=2)
    wrap_triton(merge_kernel)[(b, hq)](
        po, pml, out, po.stride(0), po.stride(1), po.stride(2), pml.stride(0), pml.stride(1), pml.stride(2),
        out.stride(0), out.stride(1), NS=ns, NSP=max(2, 1 << (ns - 1).bit_length()), D=d, num_warps=4)
    return out


def launch_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, glu: bool,
                  tiles: tuple[int, int, int, int], norm: Norm | None = None,
                  block_m: int = SMALL_LINEAR_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of the small-linear kernel (see `small_linear`) with tiles (BLOCK_N, BLOCK_K, warps,
    stages) and ``block_m`` rows per program (`SMALL_LINEAR_ROWS` or `INVARIANT_ROWS`).
    Traceable inside the op; a plain launch outside it (benchmarks/gemv_cuda.py)."""
    from torch.library import wrap_triton

    m, k = x.shape
    n_out = weight.shape[0] // 2 if glu else weight.shape[0]
    block_n, block_k, warps, stages = tiles
    # Shared memory per pipeline stage grows with the rows per program: fewer stages where needed (the
    # arithmetic of a row does not depend on the stages).
    stage_bytes = (block_m + (2 if glu else 1) * block_n) * block_k * x.element_size()
    stages = max(1, min(stages, SMEM_BUDGET // stage_bytes))
    programs = -(-n_out // block_n)
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    ss_out = torch.empty((m, programs), dtype=torch.float32, device=x.device)
    nw, ss, eps = norm if norm is not None else (out, ss_out, 0.0)  # placeholders the kernel never reads
    wrap_triton(_linear_kernel())[(-(-m // block_m), programs)](
        x, weight, out, residual if residual is not None else out, nw, ss, ss_out,
        m, n_out, k, ss.shape[1], eps, x.stride(0), weight.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, ss.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GLU=glu, RESIDUAL=residual is not None,
        NORM=norm is not None, P_POW2=max(2, 1 << (ss.shape[1] - 1).bit_length()), num_warps=warps, num_stages=stages)
    return out, ss_out


def small_linear_programs(n_out: int, glu: bool, invariant: bool = False) -> int:
    """How many partial sums of squares `small_linear` returns per row for ``n_out`` outputs."""
    return -(-n_out // small_linear_tiles(n_out, glu, invariant)[0])


def prefill_tiles(d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for head size ``d``."""
    return PREFILL_TILES.get(d, PREFILL_TILES[256] if d > 128 else PREFILL_TILES[128])  # others: the nearest


@functools.cache
def register() -> None:
    """Define the ``torch.ops.onecopy`` kernel ops (once per process)."""
    from torch.library import triton_op

    @triton_op("onecopy::decode_attention", mutates_args=())
    def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                         lengths: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D] against rows[b] of the pools [P, Hkv, S, D], positions < lengths[b]; -> [B, Hq, D]."""
        return launch_decode(q, None, k_pool, v_pool, rows, lengths)

    @triton_op("onecopy::decode_attention_rope", mutates_args=("k_pool", "v_pool"))
    def decode_attention_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                              v_pool: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """A decode step's projected qkv [B, (Hq + 2 Hkv) D]: RoPE (cos, sin [B, D]) on q and k, the new k
        and v cached in rows[b] of the pools at position lengths[b] - 1, q against positions < lengths[b];
        -> [B, Hq, D]."""
        qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()  # one row stride for both (views of [B, 1, 1, D] already are)
        return launch_decode(qkv, (cos, sin), k_pool, v_pool, rows, lengths)

    @triton_op("onecopy::prefill_attention", mutates_args=())
    def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                          positions: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] at increasing ``positions`` [T] against row rows[0] of the pools, causal; -> [T, Hq, D]."""
        if q.stride(-1) != 1:
            q = q.contiguous()
        return launch_prefill(q, k_pool, v_pool, rows, positions, prefill_tiles(q.shape[-1]))

    @triton_op("onecopy::small_linear", mutates_args=())
    def small_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, glu: bool,
                     norm_weight: torch.Tensor | None, norm_ss: torch.Tensor | None,
                     eps: float, block_m: int, invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """[M, K] rows -> ([M, N] (N/2 with ``glu``), partial sums of squares); see the module docstring.
        A row's result depends only on that row: fixed tiles, K reduced in one order, whatever M."""
        x = x if x.stride(-1) == 1 else x.contiguous()
        residual = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
        norm = None if norm_weight is None or norm_ss is None else (norm_weight, norm_ss.contiguous(), eps)
        n_out = weight.shape[0] // 2 if glu else weight.shape[0]
        return launch_linear(x, weight, residual, glu, small_linear_tiles(n_out, glu, invariant), norm, block_m)


def launch_prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                   positions: torch.Tensor, tiles: tuple[int, int, int, int]) -> torch.Tensor:
    """One launch of the prefill kernel with the given (BLOCK_M, BLOCK_N, warps, stages): what the op
    runs with `prefill_tiles`, and what benchmarks/prefill_attention_cuda.py times with other tiles.
    Traceable inside the op (wrap_triton); a plain launch outside it."""
    from torch.library import wrap_triton

    t, hq, d = q.shape
    block_m, block_n, warps, stages = tiles
    out = torch.empty_like(q)
    wrap_triton(_prefill_kernel())[((t + block_m - 1) // block_m, hq)](
        q, k_pool, v_pool, rows, positions, out, t,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), out.stride(0), out.stride(1),
        G=hq // k_pool.shape[1], D=d, BLOCK_M=block_m, BLOCK_N=block_n, QK_SCALE=d ** -0.5 * 1.4426950408889634,
        num_warps=warps, num_stages=stages)
    return out


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    """See the op: a prefill chunk's causal attention over its pool row, read in place (CUDA only)."""
    register()
    return torch.ops.onecopy.prefill_attention(q, k_pool, v_pool, rows, positions)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor:
    register()
    return torch.ops.onecopy.decode_attention(q, k_pool, v_pool, rows, lengths)


def decode_attention_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                          v_pool: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """See the op: a decode step's attention from its projected rows ``qkv`` [B, (Hq + 2 Hkv) D], with
    RoPE (cos, sin [B, D]) and the write of the new k/v at ``positions`` [B] folded in (CUDA only)."""
    register()
    return torch.ops.onecopy.decode_attention_rope(qkv, cos, sin, k_pool, v_pool, rows, positions + 1)


def small_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
                 glu: bool = False, norm: Norm | None = None, block_m: int = SMALL_LINEAR_ROWS,
                 invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """See the op: ``x`` [M, K] through ``weight`` [N, K] in one kernel (CUDA only; batch-invariant),
    with RMSNorm before it (``norm``: its weight, the partial sums of squares of ``x``'s rows [M, P] that
    the kernel producing ``x`` returned, eps) and SwiGLU or a residual add after it. Returns the output
    [M, N'] and its rows' partial sums of squares [M, `small_linear_programs`] (fp32), for a norm after.
    ``block_m`` rows per program: `SMALL_LINEAR_ROWS` (fastest for a few rows) or `INVARIANT_ROWS`;
    ``invariant``: the tiles of the batch-invariant decode (one BLOCK_N and BLOCK_K for both).
    Needs `register` to have run (it cannot run inside the ``torch.cond`` branch that calls this)."""
    nw, ss, eps = norm if norm is not None else (None, None, 0.0)
    return torch.ops.onecopy.small_linear(x, weight, residual, glu, nw, ss, eps, block_m, invariant)
