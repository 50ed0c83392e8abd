"""Small linear: ``x @ weight.T`` for a decode step's few rows, with the elementwise work around it folded in.

One program per `BLOCK_N` output features and block of rows (`SMALL_LINEAR_ROWS`; `INVARIANT_ROWS`
in the batch-invariant decode past that many) streams its weight rows once, with SwiGLU of a fused
gate/up weight (``glu``) or a residual add after it, and the RMSNorm before it. A norm needs its
row's sum of squares before any program can start, and every program redoing that reduction cost
more than a separate norm kernel on the H200; so each kernel also writes its programs' partial sums
of squares of its output rows, and the next kernel's programs add up those few floats (one kernel
fewer per norm, nothing re-read). cuBLAS splits such a skinny product over K and reduces in a second
kernel; this reads each weight once, in one kernel, at close to the copy bandwidth
(benchmarks/gemv_cuda.py). Wider batches keep cuBLAS (`projections.by_rows` picks per call).
A packed (quantized) weight goes through the same kernel (``LAYOUT`` > 0, `ops.packed_linear`): each
[BLOCK_N, BLOCK_K] tile of int8 or 4-bit values is dequantized in fp32 with its groups' scales (and
mins) as it is read and rounded once to the activations' dtype, the folds unchanged; its tiles are
`tiles.packed_linear_tiles`. That fp32 arithmetic, not the bytes, bounds it today
(benchmarks/packed_gemv_cuda.py).
The op is defined in `ops`; the tiles are `tiles.small_linear_tiles`.
"""

from __future__ import annotations

import functools

import torch

from .tiles import SMALL_LINEAR_ROWS, SMEM_BUDGET

# An RMSNorm folded into small_linear: (weight, partial sums of squares of each row [M, P], eps).
Norm = tuple[torch.Tensor, torch.Tensor, float]


@functools.cache
def _linear_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def linear_kernel(X, W, S, MN, OUT, R, NW, SS, SS_OUT, M, N_OUT, K, P_IN, eps, stride_xm, stride_wn, stride_sn,
                      stride_om, stride_rm, stride_ssm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GLU: tl.constexpr, RESIDUAL: tl.constexpr, NORM: tl.constexpr,
                      P_POW2: tl.constexpr, LAYOUT: tl.constexpr, GROUP: tl.constexpr):
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
            for half in tl.static_range(2 if GLU else 1):  # GLU: the up projection's rows follow the gate's
                rows = offs_n + half * N_OUT
                wmask = nmask[:, None] & kmask[None, :]
                if LAYOUT == 0:  # a float weight
                    w = tl.load(W + rows[:, None] * stride_wn + kk[None, :], mask=wmask, other=0.0)
                else:  # packed (models.packed.LAYOUTS): the tile dequantized in fp32, rounded once to x's dtype
                    if LAYOUT == 2 or LAYOUT == 3:  # two values a byte: k = 2i low nibble, 2i + 1 high
                        kb = k // 2 + tl.arange(0, BLOCK_K // 2)
                        b = tl.load(W + rows[:, None] * stride_wn + kb[None, :],
                                    mask=nmask[:, None] & (kb < K // 2)[None, :], other=0)
                        q = tl.join(b & 15, b >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32)
                    else:
                        q = tl.load(W + rows[:, None] * stride_wn + kk[None, :], mask=wmask, other=0).to(tl.float32)
                    if LAYOUT == 2:
                        q = q - 8.0
                    kg = k // GROUP + tl.arange(0, BLOCK_K // GROUP)
                    gmask = nmask[:, None] & (kg < K // GROUP)[None, :]
                    s = tl.load(S + rows[:, None] * stride_sn + kg[None, :], mask=gmask, other=0.0)
                    wf = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s[:, :, None]
                    if LAYOUT == 3 or LAYOUT == 4:  # affine: + min, a second rounding as in the reference
                        mn = tl.load(MN + rows[:, None] * stride_sn + kg[None, :], mask=gmask, other=0.0)
                        wf = wf + mn[:, :, None]
                    w = tl.reshape(wf, (BLOCK_N, BLOCK_K)).to(dtype)
                if half == 0:
                    acc += tl.dot(x, tl.trans(w))  # tensor cores even for one row: FMAs were 1.2-1.5x slower
                else:
                    acc_up += tl.dot(x, tl.trans(w))
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


# A packed weight's other operands (models.packed): scales, mins (affine layouts; else None), the layout's
# number (models.packed.LAYOUT_IDS) and the values per scale.
PackedArgs = tuple[torch.Tensor, torch.Tensor | None, int, int]


def launch_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, glu: bool,
                  tiles: tuple[int, int, int, int], norm: Norm | None = None,
                  block_m: int = SMALL_LINEAR_ROWS, packed: PackedArgs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of the small-linear kernel (see `small_linear`) with tiles (BLOCK_N, BLOCK_K, warps,
    stages) and ``block_m`` rows per program (`SMALL_LINEAR_ROWS` or `INVARIANT_ROWS`); with ``packed``,
    ``weight`` is a packed weight's values (BLOCK_K at least its group).
    Traceable inside the op; a plain launch outside it (benchmarks/gemv_cuda.py)."""
    from torch.library import wrap_triton

    m, k = x.shape
    n_out = weight.shape[0] // 2 if glu else weight.shape[0]
    block_n, block_k, warps, stages = tiles
    scales, mins, layout, group = packed if packed is not None else (weight, None, 0, 1)
    if packed is not None:
        block_k = max(block_k, group)
    # Shared memory per pipeline stage grows with the rows per program: fewer stages where needed (the
    # arithmetic of a row does not depend on the stages).
    w_bytes = block_k * weight.element_size() // (2 if layout in (2, 3) else 1)
    stage_bytes = block_m * block_k * x.element_size() + (2 if glu else 1) * block_n * w_bytes
    stages = max(1, min(stages, SMEM_BUDGET // stage_bytes))
    programs = -(-n_out // block_n)
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    ss_out = torch.empty((m, programs), dtype=torch.float32, device=x.device)
    nw, ss, eps = norm if norm is not None else (out, ss_out, 0.0)  # placeholders the kernel never reads
    wrap_triton(_linear_kernel())[(-(-m // block_m), programs)](
        x, weight, scales, mins if mins is not None else scales, out, residual if residual is not None else out,
        nw, ss, ss_out, m, n_out, k, ss.shape[1], eps, x.stride(0), weight.stride(0), scales.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, ss.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GLU=glu, RESIDUAL=residual is not None,
        NORM=norm is not None, P_POW2=max(2, 1 << (ss.shape[1] - 1).bit_length()), LAYOUT=layout, GROUP=group,
        num_warps=warps, num_stages=stages)
    return out, ss_out
