"""The packed (quantized) weight layouts as a bundle names them: the layout names, the tensors a packed
layer is stored as, and the shape check a manifest's ``packed`` entry must pass.

A leaf: it imports no model or kernel code, so reading a manifest (`bundle`) does not pull them in.
The weights themselves, their arithmetic and the layers that hold them are `models.packed`.
"""

from __future__ import annotations

import torch

# layout -> (values per byte, affine): value = s * q (q8s), s * (q - 8) (q4z), s * q + m (q4a, q8a)
# f8r: value = s * q with q float8 e4m3 and one s per output feature (a group of K)
# <layout>_mma: the same values in the native CUDA kernel's tile order (`models.mma_order`; the export writes it
# for a CUDA bundle): qweight and scales keep their shapes, their contents are permuted.
LAYOUTS: dict[str, tuple[int, bool]] = {"q8s": (1, False), "q4z": (2, False), "q4a": (2, True), "q8a": (1, True),
                                        "f8r": (1, False), "q4z_mma": (2, False), "q4a_mma": (2, True),
                                        "q8s_mma": (1, False)}
MMA_LAYOUTS = {"q4z": "q4z_mma", "q4a": "q4a_mma", "q8s": "q8s_mma"}  # stored order -> tile order
MMA_GROUPS = (32, 64, 128)  # the groups the tile order (and its kernel) takes
# Each tile-ordered layout's number, as the native kernels' PackedLayout enum takes it (packed_linear.h).
MMA_LAYOUT_IDS = {"q4z_mma": 1, "q4a_mma": 2, "q8s_mma": 3}
# f8r's number there: its GEMV reads the weight as stored (row-major e4m3, as cuBLAS's FP8 GEMM does for more rows).
F8R_NATIVE_ID = 4
# Each kernel-read layout's number, as the Triton kernels' LAYOUT constexpr and the CPU kernel's Layout enum
# take it (0 is a float weight in the Triton kernels).
LAYOUT_IDS = {"q8s": 1, "q4z": 2, "q4a": 3, "q8a": 4}
GROUPS = (16, 32, 64, 128)  # values per scale the kernels read (a power of two, at most one K tile)
PACKED_PARTS = ("qweight", "scales", "mins")  # the buffers a packed layer holds, in this order


def check_packed(layout: str, group: int, shape: tuple[int, ...], qweight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None) -> None:
    """Raise ValueError unless the tensors are a consistent ``layout`` weight of float shape ``shape``: [N, K], or
    [E, N, K] for a stack of experts (each [N, K] of the layout, the leading dims kept by every tensor)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown weight layout {layout!r}; this onecopy reads {', '.join(LAYOUTS)}")
    per_byte, affine = LAYOUTS[layout]
    *lead, n, k = shape
    want_q = {"q8s": torch.int8, "q8s_mma": torch.int8, "f8r": torch.float8_e4m3fn}.get(layout, torch.uint8)
    tiles = layout not in MMA_LAYOUT_IDS or (not lead and tiles_fit(layout, group, n, k))
    ok = ((group == k if layout == "f8r" else group in GROUPS) and k % group == 0 and k % per_byte == 0 and tiles
          and qweight.dtype == want_q
          and tuple(qweight.shape) == (*lead, n, k // per_byte) and scales.dtype == torch.float32
          and tuple(scales.shape) == (*lead, n, k // group) and (mins is not None) == affine
          and (mins is None or (mins.dtype == torch.float32 and mins.shape == scales.shape)))
    if not ok:
        raise ValueError(f"a {layout} weight of shape {list(shape)}, group {group} needs qweight {want_q} "
                         f"{[*lead, n, k // per_byte]} and float32 scales{' and mins' if affine else ''} "
                         f"{[*lead, n, k // group]}; "
                         f"got qweight {qweight.dtype} {list(qweight.shape)}, scales {scales.dtype} {list(scales.shape)}"
                         f"{'' if mins is None else f', mins {list(mins.shape)}'} (groups: {GROUPS}; f8r: one per row, K; "
                         f"the _mma layouts: groups {MMA_GROUPS}, N a multiple of 16, K of {mma_chunk(layout)})")


def tiles_fit(layout: str, group: int, n: int, k: int) -> bool:
    """Whether a [N, K] weight of ``layout`` (stored or tile order) with this group fits the native kernel's
    tiles: groups `MMA_GROUPS`, N a multiple of 16 (a tile's features), K of a tile row's values."""
    return group in MMA_GROUPS and n % 16 == 0 and k % mma_chunk(layout) == 0


def mma_chunk(layout: str) -> int:
    """Values per tile row of a tile-ordered layout (one 16-byte load per thread of a warp): 64 at 4 bits, 32 at 8."""
    return 64 if LAYOUTS[layout][0] == 2 else 32
