"""Dequantize a packed weight on the device: what a prefill chunk's cuBLAS GEMM reads (CUDA).

A prefill chunk multiplies many rows by each weight, so it runs cuBLAS on the weight dequantized to
the activations' dtype, one layer at a time (`models.packed.matmul`). One Triton kernel writes that
copy at close to the copy bandwidth: each program dequantizes a [BLOCK_N, BLOCK_K] tile in fp32 as
`models.packed.dequantize` does (s * q, + m for the affine layouts) and rounds it once.
The op is defined in `ops`.
"""

from __future__ import annotations

import functools

import torch

TILE = (32, 256)  # (rows, values) per program: whole groups (GROUPS <= 128) and 64 B or more per row read


@functools.cache
def _dequant_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequant_kernel(W, S, MN, OUT, N, K, stride_wn, stride_sn, stride_on, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP: tl.constexpr, LAYOUT: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.program_id(1) * BLOCK_K
        nmask = rows < N
        kk = k + tl.arange(0, BLOCK_K)
        if LAYOUT == 2 or LAYOUT == 3:  # two values a byte: k = 2i low nibble, 2i + 1 high
            kb = k // 2 + tl.arange(0, BLOCK_K // 2)
            b = tl.load(W + rows[:, None] * stride_wn + kb[None, :], mask=nmask[:, None] & (kb < K // 2)[None, :],
                        other=0)
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
        if LAYOUT == 3 or LAYOUT == 4:
            w = w + tl.load(MN + rows[:, None] * stride_sn + kg[None, :], mask=gmask, other=0.0)[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(OUT.dtype.element_ty)
        tl.store(OUT + rows[:, None] * stride_on + kk[None, :], w, mask=nmask[:, None] & (kk < K)[None, :])

    return dequant_kernel


def launch_dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, layout: int, group: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in ``dtype`` from its packed values (``layout``: models.packed.LAYOUT_IDS)."""
    from torch.library import wrap_triton

    n, k = scales.shape[0], scales.shape[1] * group
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n, block_k = TILE
    block_k = max(block_k, group)
    wrap_triton(_dequant_kernel())[(-(-n // block_n), -(-k // block_k))](
        qweight, scales, mins if mins is not None else scales, out, n, k, qweight.stride(0), scales.stride(0),
        out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, GROUP=group, LAYOUT=layout, num_warps=4)
    return out
