"""Qwen3.5's gated DeltaNet decode step in one Triton kernel (`deltanet_decode`): a session's conv window and
recurrent state read once and written once, nothing between the input projection and the output projection
written to memory but the normed output.

What the eager step (`models.qwen3_5_deltanet.GatedDeltaNet`, decode) does in ~25 kernels, per session row and
key head, in one program: the causal conv1d over the conv window (the state's ``kernel`` inputs and the new one;
the window shifted back into the pool), SiLU, the l2 norms of q and k (q scaled by dk^-1/2), and for each of the
key head's value heads (grouped: value head h reads key head h // rep) the gates (beta = sigmoid(b), decay
exp(-exp(A_log) softplus(a + dt_bias))), the delta rule on the [dk, dv] fp32 state (decay, read-out of k, the
rank-1 update, read-out of q), and the gated RMSNorm of the output (w * norm(o) * silu(z)). A program owns its
key head's q / k conv channels and its value heads' v channels and states, so no program reads what another
writes. A row whose position is 0 starts from zero state (the pools may hold a finished session's). The rounding
points follow the eager step (the conv's SiLU output, beta and the output in the model dtype before the norm), so
the kernel differs from it only by fp32 summation order. A row's bits depend on that row alone (batch-invariant).
The op is defined in `ops`; the kernel's source is `deltanet_triton`, imported when it is first launched.
"""

from __future__ import annotations

import torch


def launch_deltanet_decode(proj: torch.Tensor, conv_pool: torch.Tensor, conv_w: torch.Tensor, rec_pool: torch.Tensor,
                           a_log: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor, rows: torch.Tensor,
                           positions: torch.Tensor, n_k_heads: int, eps: float, wrap: bool = True) -> torch.Tensor:
    """A decode step of N sessions: ``proj`` [N, conv_dim + value_dim + 2 nv] the input projection (mixed q k v,
    z, b, a), ``conv_pool`` [P, conv_dim, kernel] and ``rec_pool`` [P, nv, dk, dv] (fp32) updated in place at
    ``rows`` [N] (zero state where ``positions`` [N] is 0), ``conv_w`` [conv_dim, 1, kernel]; returns the gated,
    normed output [N, nv dv] in proj's dtype (the output projection's input). ``wrap=False`` launches the kernel
    directly (Triton's interpreter, outside any trace)."""
    from torch.library import wrap_triton

    n = proj.shape[0]
    nv, dk, dv = rec_pool.shape[1:]
    conv_dim, kernel = conv_pool.shape[1:]
    if conv_dim != 2 * n_k_heads * dk + nv * dv or proj.shape[1] != conv_dim + nv * dv + 2 * nv:
        raise ValueError(f"deltanet_decode: proj {tuple(proj.shape)} and the pools {tuple(conv_pool.shape)}, "
                         f"{tuple(rec_pool.shape)} do not describe one layer of {n_k_heads} key heads")
    proj = proj if proj.stride(-1) == 1 else proj.contiguous()
    out = torch.empty((n, nv * dv), dtype=proj.dtype, device=proj.device)
    from .deltanet_triton import deltanet_decode_kernel as kern  # here: it imports Triton

    launch = wrap_triton(kern) if wrap else kern
    launch[(n, n_k_heads)](
        proj, conv_pool, conv_w.reshape(conv_dim, kernel).contiguous(), rec_pool, a_log, dt_bias, norm_w, rows,
        positions, out, proj.stride(0), out.stride(0), eps, dk ** -0.5, NK=n_k_heads, NV=nv, DK=dk, DV=dv, K=kernel,
        BK=_pow2(dk), BV=_pow2(dv), KP=_pow2(kernel), num_warps=4 if dk * dv <= 64 * 64 else 8)
    return out


def launch_deltanet_chunk_scan(new_values: torch.Tensor, k_cumdecay: torch.Tensor, q_dec: torch.Tensor,
                               k_dec: torch.Tensor, intra: torch.Tensor, chunk_decay: torch.Tensor,
                               state: torch.Tensor, wrap: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill's chunk-to-chunk recurrence (`models.qwen3_5_deltanet.scan_chunks`'s loop) in one kernel: per value
    head H and chunk n of C positions, ``new_values`` [H, n, C, dv], ``k_cumdecay``, ``q_dec``, ``k_dec`` [H, n, C,
    dk], ``intra`` [H, n, C, C], ``chunk_decay`` [H, n], the state before the first chunk [H, dk, dv]; all fp32.
    Returns the output [H, n, C, dv] and the state after the last chunk. The chunk count is a run-time value, so a
    graph holds one launch for any prompt length (the loop in torch ops is unrolled once per chunk)."""
    from torch.library import wrap_triton

    h, n, c, dv = new_values.shape
    dk = k_cumdecay.shape[-1]
    if (k_cumdecay.shape != (h, n, c, dk) or q_dec.shape != k_cumdecay.shape or k_dec.shape != k_cumdecay.shape
            or intra.shape != (h, n, c, c) or chunk_decay.shape != (h, n) or state.shape != (h, dk, dv)):
        raise ValueError(f"deltanet_chunk_scan: new_values {tuple(new_values.shape)}, k_cumdecay "
                         f"{tuple(k_cumdecay.shape)}, intra {tuple(intra.shape)}, state {tuple(state.shape)} do not "
                         "describe one prefill's chunks")
    if c != _pow2(c) or dk != _pow2(dk) or dv != _pow2(dv) or min(c, dk, dv) < 16:
        raise ValueError(f"deltanet_chunk_scan: chunk {c}, dk {dk} and dv {dv} must be powers of two of 16 or more")
    out = new_values.new_empty(new_values.shape)  # contiguous (new_values is a view of the solve's output)
    state_out = state.new_empty(state.shape)
    from .deltanet_triton import deltanet_chunk_scan_kernel as kern  # here: it imports Triton

    bv = min(32, dv)
    # the next chunk's loads overlap this one's products where two chunks' fp32 tiles fit in shared memory (35B-A3B's
    # heads: ~139 KB; Triton's default three stages would need 256 KB)
    big = new_values.is_cuda and torch.cuda.get_device_properties(new_values.device).shared_memory_per_block_optin \
        >= 160 * 1024
    launch = wrap_triton(kern) if wrap else kern
    launch[(h, dv // bv)](new_values.contiguous(), k_cumdecay.contiguous(), q_dec.contiguous(), k_dec.contiguous(),
                          intra.contiguous(), chunk_decay.contiguous(), state.contiguous(), out, state_out, n,
                          C=c, DK=dk, DV=dv, BV=bv, num_warps=8 if c * dk >= 64 * 128 else 4,
                          num_stages=2 if big else 1)
    return out, state_out


def _pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()
