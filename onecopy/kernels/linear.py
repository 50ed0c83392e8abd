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
The op is defined in `ops`, the Triton source in `linear_triton`; the tiles are `tiles.small_linear_tiles`.
"""

from __future__ import annotations

import torch

from .tiles import SMALL_LINEAR_ROWS, SMEM_BUDGET

# An RMSNorm folded into small_linear: (weight, partial sums of squares of each row [M, P], eps).
Norm = tuple[torch.Tensor, torch.Tensor, float]

# A packed weight's other operands (models.packed): scales, mins (affine layouts; else None), the layout's
# number (layouts.LAYOUT_IDS) and the values per scale.
PackedArgs = tuple[torch.Tensor, torch.Tensor | None, int, int]


def launch_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, glu: bool,
                  tiles: tuple[int, int, int, int], norm: Norm | None = None,
                  block_m: int = SMALL_LINEAR_ROWS, packed: PackedArgs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of the small-linear kernel (see `small_linear`) with tiles (BLOCK_N, BLOCK_K, warps,
    stages) and ``block_m`` rows per program (`SMALL_LINEAR_ROWS` or `INVARIANT_ROWS`); with ``packed``,
    ``weight`` is a packed weight's values (BLOCK_K at least its group).
    Traceable inside the op; a plain launch outside it (benchmarks/gemv_cuda.py)."""
    from torch.library import wrap_triton

    from .linear_triton import linear_kernel  # here: it imports Triton

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
    wrap_triton(linear_kernel)[(-(-m // block_m), programs)](
        x, weight, scales, mins if mins is not None else scales, out, residual if residual is not None else out,
        nw, ss, ss_out, m, n_out, k, ss.shape[1], eps, x.stride(0), weight.stride(0), scales.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, ss.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GLU=glu, RESIDUAL=residual is not None,
        NORM=norm is not None, P_POW2=max(2, 1 << (ss.shape[1] - 1).bit_length()), LAYOUT=layout, GROUP=group,
        num_warps=warps, num_stages=stages)
    return out, ss_out
