"""The Triton source of `deltanet`'s decode kernel (imported on its first launch: it imports Triton)."""

import triton
import triton.language as tl


@triton.jit
def conv_channels(x_row, state_row, w, ch, mask, taps, fresh, K: tl.constexpr):
    """fp32 conv output of channels ``ch`` (the new input x_row[ch] and the K inputs before it); the window's
    last K inputs written back as the channels' state."""
    x_new = tl.load(x_row + ch, mask=mask, other=0.0).to(tl.float32)
    shifted = mask[:, None] & (taps[None, :] + 1 < K)
    prev = tl.load(state_row + ch[:, None] * K + taps[None, :] + 1, mask=shifted, other=0.0).to(tl.float32)
    prev = tl.where(fresh, 0.0, prev)
    window = tl.where(taps[None, :] == K - 1, x_new[:, None], prev)  # inputs t - K + 1 .. t
    inside = mask[:, None] & (taps[None, :] < K)
    wt = tl.load(w + ch[:, None] * K + taps[None, :], mask=inside, other=0.0).to(tl.float32)
    tl.debug_barrier()  # every read of the old window before any write of the new
    tl.store(state_row + ch[:, None] * K + taps[None, :], window.to(state_row.dtype.element_ty), mask=inside)
    return tl.sum(window * wt, axis=1)

@triton.jit
def silu_rounded(x, DT: tl.constexpr):
    return (x * tl.sigmoid(x)).to(DT).to(tl.float32)

@triton.jit
def deltanet_decode_kernel(proj, conv_pool, conv_w, rec_pool, a_log, dt_bias, norm_w, rows, pos, out,
                           stride_p, stride_o, eps, q_scale,
                           NK: tl.constexpr, NV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                           K: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KP: tl.constexpr):
    n = tl.program_id(0)
    kh = tl.program_id(1)
    REP: tl.constexpr = NV // NK
    KEY_DIM: tl.constexpr = NK * DK
    C: tl.constexpr = 2 * KEY_DIM + NV * DV  # conv channels: q, k, v
    DT = out.dtype.element_ty
    row = tl.load(rows + n).to(tl.int64)
    fresh = tl.load(pos + n) == 0
    x_row = proj + n * stride_p
    state_row = conv_pool + row * (C * K)
    taps = tl.arange(0, KP)
    ck = tl.arange(0, BK)
    mk = ck < DK
    q = silu_rounded(conv_channels(x_row, state_row, conv_w, kh * DK + ck, mk, taps, fresh, K), DT)
    k = silu_rounded(conv_channels(x_row, state_row, conv_w, KEY_DIM + kh * DK + ck, mk, taps, fresh, K), DT)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    cv = tl.arange(0, BV)
    mv = cv < DV
    s_mask = mk[:, None] & mv[None, :]
    for i in tl.static_range(REP):
        h = kh * REP + i
        v = silu_rounded(conv_channels(x_row, state_row, conv_w, 2 * KEY_DIM + h * DV + cv, mv, taps, fresh, K),
                         DT)
        b = tl.load(x_row + C + NV * DV + h).to(tl.float32)
        a = tl.load(x_row + C + NV * DV + NV + h).to(tl.float32)
        beta = tl.sigmoid(b).to(DT).to(tl.float32)  # the eager step's sigmoid runs in the model dtype
        sp = a + tl.load(dt_bias + h).to(tl.float32)
        sp = tl.where(sp > 20.0, sp, tl.log(1.0 + tl.exp(sp)))  # softplus, torch's threshold
        decay = tl.exp(-tl.exp(tl.load(a_log + h).to(tl.float32)) * sp)
        s_ptr = rec_pool + (row * NV + h) * (DK * DV) + ck[:, None] * DV + cv[None, :]
        s = tl.load(s_ptr, mask=s_mask, other=0.0)
        s = tl.where(fresh, 0.0, s) * decay
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        tl.store(s_ptr, s, mask=s_mask)
        o = tl.sum(s * q[:, None], axis=0).to(DT).to(tl.float32)
        o = (o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + eps)).to(DT).to(tl.float32)
        o = (tl.load(norm_w + cv, mask=mv, other=0.0).to(tl.float32) * o).to(DT).to(tl.float32)
        z = tl.load(x_row + C + h * DV + cv, mask=mv, other=0.0).to(tl.float32)
        tl.store(out + n * stride_o + h * DV + cv, (o * (z * tl.sigmoid(z))).to(DT), mask=mv)


@triton.jit
def deltanet_chunk_scan_kernel(new_values, k_cumdecay, q_dec, k_dec, intra, chunk_decay, state, out, state_out,
                               n_chunks, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    """The state hand-over between a prefill's chunks for value head program_id(0), value columns program_id(1) * BV
    ...: the [DK, BV] state stays in registers from the first chunk to the last (fp32 products, no TF32)."""
    h = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, C)
    dk = tl.arange(0, DK)
    v = tl.program_id(1) * BV + tl.arange(0, BV)
    s = tl.load(state + h * DK * DV + dk[:, None] * DV + v[None, :])
    for i in tl.range(0, n_chunks):
        chunk = h * n_chunks + i
        rows_k = chunk * C * DK + c[:, None] * DK + dk[None, :]
        rows_v = chunk * C * DV + c[:, None] * DV + v[None, :]
        v_new = tl.load(new_values + rows_v) - tl.dot(tl.load(k_cumdecay + rows_k), s, input_precision="ieee")
        o = tl.dot(tl.load(q_dec + rows_k), s, input_precision="ieee")
        o += tl.dot(tl.load(intra + chunk * C * C + c[:, None] * C + c[None, :]), v_new, input_precision="ieee")
        tl.store(out + rows_v, o)
        s = s * tl.load(chunk_decay + chunk) + tl.dot(tl.trans(tl.load(k_dec + rows_k)), v_new,
                                                       input_precision="ieee")
    tl.store(state_out + h * DK * DV + dk[:, None] * DV + v[None, :], s)
