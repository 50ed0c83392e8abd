"""Dequantize a packed weight on the device: what a prefill chunk's cuBLAS GEMM reads (CUDA).

A prefill chunk multiplies many rows by each weight, so it runs cuBLAS on the weight dequantized to
the activations' dtype, one layer at a time (`models.linear.matmul`). One Triton kernel writes that
copy at close to the copy bandwidth: each program dequantizes a [BLOCK_N, BLOCK_K] tile in fp32 as
`models.packed.dequantize` does (s * q, + m for the affine layouts) and rounds it once.
The op is defined in `ops`; the kernel shares its tile dequantization with the small linear's
(`linear_triton.dequantized_tile`).
"""

from __future__ import annotations

import torch

TILE = (32, 256)  # (rows, values) per program: whole groups (GROUPS <= 128) and 64 B or more per row read


def launch_dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, layout: int, group: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in ``dtype`` from its packed values (``layout``: layouts.LAYOUT_IDS)."""
    from torch.library import wrap_triton

    from .linear_triton import dequant_kernel  # here: it imports Triton

    n, k = scales.shape[0], scales.shape[1] * group
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n, block_k = TILE
    block_k = max(block_k, group)
    wrap_triton(dequant_kernel)[(-(-n // block_n), -(-k // block_k))](
        qweight, scales, mins if mins is not None else scales, out, n, k, qweight.stride(0), scales.stride(0),
        out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, GROUP=group, LAYOUT=layout, num_warps=4)
    return out
