"""The Triton source of the small-linear and dequantize kernels (`linear`, `dequant`), at module level:
AOTInductor embeds a user kernel with the Triton functions it calls from its module's globals, so the
one packed-tile dequantization (`dequantized_tile`) that both kernels call lives here. Imported on a
kernel's first launch (it imports Triton), never by a CPU-only process."""

import triton
import triton.language as tl


@triton.jit
def dequantized_tile(W, S, MN, rows, nmask, k, K, stride_wn, stride_sn, dtype: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP: tl.constexpr, LAYOUT: tl.constexpr):
    """Packed weight rows ``rows`` at values k.. as a [BLOCK_N, BLOCK_K] ``dtype`` tile: `models.packed.dequantize`'s
    arithmetic (fp32: s * q, + m for the affine layouts), rounded once."""
    kk = k + tl.arange(0, BLOCK_K)
    if LAYOUT == 2 or LAYOUT == 3:  # two values a byte: k = 2i low nibble, 2i + 1 high
        kb = k // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(W + rows[:, None] * stride_wn + kb[None, :], mask=nmask[:, None] & (kb < K // 2)[None, :], other=0)
        q = tl.join(b & 15, b >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32)
    else:
        q = tl.load(W + rows[:, None] * stride_wn + kk[None, :], mask=nmask[:, None] & (kk < K)[None, :],
                    other=0).to(tl.float32)
    if LAYOUT == 2:
        q = q - 8.0
    kg = k // GROUP + tl.arange(0, BLOCK_K // GROUP)
    gmask = nmask[:, None] & (kg < K // GROUP)[None, :]
    s = tl.load(S + rows[:, None] * stride_sn + kg[None, :], mask=gmask, other=0.0)
    w = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)) * s[:, :, None]
    if LAYOUT == 3 or LAYOUT == 4:  # affine: + min, a second rounding as in the reference
        w = w + tl.load(MN + rows[:, None] * stride_sn + kg[None, :], mask=gmask, other=0.0)[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K)).to(dtype)


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
            if LAYOUT == 0:  # a float weight
                w = tl.load(W + rows[:, None] * stride_wn + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            else:  # packed (layouts.LAYOUTS): the tile dequantized in fp32, rounded once to x's dtype
                w = dequantized_tile(W, S, MN, rows, nmask, k, K, stride_wn, stride_sn, dtype, BLOCK_N, BLOCK_K, GROUP,
                                     LAYOUT)
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


@triton.jit
def dequant_kernel(W, S, MN, OUT, N, K, stride_wn, stride_sn, stride_on, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP: tl.constexpr, LAYOUT: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile of a packed weight, dequantized to OUT's dtype (`dequant`)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K
    nmask = rows < N
    kk = k + tl.arange(0, BLOCK_K)
    w = dequantized_tile(W, S, MN, rows, nmask, k, K, stride_wn, stride_sn, OUT.dtype.element_ty, BLOCK_N, BLOCK_K,
                         GROUP, LAYOUT)
    tl.store(OUT + rows[:, None] * stride_on + kk[None, :], w, mask=nmask[:, None] & (kk < K)[None, :])
