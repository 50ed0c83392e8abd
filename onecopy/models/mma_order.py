"""The native CUDA kernels' tile order of a packed weight (`layouts.MMA_LAYOUTS`), and back.

The export writes a CUDA bundle's q4z / q4a / q8s projections in this order (the ``_mma`` layouts) so that
the decode kernel (kernels/native/packed_linear.cu, whose header comment draws the order) loads each
thread's tensor-core fragments with one 16-byte load and nothing is shuffled at run time. Same values,
same tensor shapes: only the positions of the bytes (and of the scales) change.

For a tile of 16 output features and a chunk of 64 (4-bit) or 32 (8-bit) values of K, lane 4 g + t of a
warp holds 16 bytes; with row = 16 f + 8 h + g and k = chunk + 16 j + 4 t + 2 p + e:
  4-bit: byte j * 4 + 2 e + p of the lane's 16, nibble h (low, high);
  8-bit: byte (2 j + h) * 4 + 2 e + p.
Scales and mins [N, K / group] become [N / 16, K / group, 16] (a tile's 16 features side by side).
Plain view/permute arithmetic: traceable, so the CPU graphs (and the tests) read the order back with it.
"""

from __future__ import annotations

import torch

from ..layouts import LAYOUTS, MMA_LAYOUTS, tiles_fit

PLAIN_LAYOUTS = {v: k for k, v in MMA_LAYOUTS.items()}  # tile order -> stored order


def orderable(layout: str, group: int, shape: tuple[int, int]) -> bool:
    """True when a ``layout`` weight of float ``shape`` [N, K] has a tile order (its kernel serves it)."""
    return layout in MMA_LAYOUTS and tiles_fit(layout, group, *shape)


def order_values(qweight: torch.Tensor, layout: str) -> torch.Tensor:
    """A stored-order ``qweight`` (layout q4z / q4a / q8s) in the tile order, same shape and dtype."""
    n = qweight.shape[0]
    f = n // 16
    if LAYOUTS[layout][0] == 2:
        k = qweight.shape[1] * 2
        u = torch.stack((qweight & 0x0F, qweight >> 4), dim=-1).reshape(f, 2, 8, k // 64, 4, 4, 2, 2)  # f h g c j t p e
        b = u[:, 0] | (u[:, 1] << 4)  # f g c j t p e: the low nibble is row g, the high one row g + 8
        return b.permute(0, 2, 1, 4, 3, 6, 5).reshape(n, k // 2)  # f c g t j e p
    k = qweight.shape[1]
    v = qweight.reshape(f, 2, 8, k // 32, 2, 4, 2, 2)  # f h g c j t p e
    return v.permute(0, 3, 2, 5, 4, 1, 7, 6).reshape(n, k)  # f c g t j h e p


def unorder_values(qweight: torch.Tensor, layout: str) -> torch.Tensor:
    """A tile-ordered ``qweight`` (layout q4z_mma / q4a_mma / q8s_mma) back in the stored order."""
    n = qweight.shape[0]
    f = n // 16
    if LAYOUTS[layout][0] == 2:
        k = qweight.shape[1] * 2
        b = qweight.reshape(f, k // 64, 8, 4, 4, 2, 2)  # f c g t j e p
        u = torch.stack((b & 0x0F, b >> 4), dim=-1)  # f c g t j e p h
        v = u.permute(0, 7, 2, 1, 4, 3, 6, 5).reshape(n, k // 2, 2)  # f h g c j t p e -> rows, byte, nibble
        return v[..., 0] | (v[..., 1] << 4)
    k = qweight.shape[1]
    v = qweight.reshape(f, k // 32, 8, 4, 2, 2, 2, 2)  # f c g t j h e p
    return v.permute(0, 5, 2, 1, 4, 3, 7, 6).reshape(n, k)


def order_groups(t: torch.Tensor) -> torch.Tensor:
    """Scales (or mins) [N, K / group] in the tile order [N / 16, K / group, 16], kept as [N, K / group]."""
    n, groups = t.shape
    return t.reshape(n // 16, 16, groups).transpose(1, 2).reshape(n, groups)


def unorder_groups(t: torch.Tensor) -> torch.Tensor:
    """`order_groups` undone."""
    n, groups = t.shape
    return t.reshape(n // 16, groups, 16).transpose(1, 2).reshape(n, groups)
