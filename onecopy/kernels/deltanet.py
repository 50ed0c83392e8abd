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


def _pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()
