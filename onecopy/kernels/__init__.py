"""Triton kernels the exported CUDA methods call, as ``torch.ops.onecopy`` ops that AOTInductor embeds.

One module per kernel family; the models call the ops through the functions re-exported here:

- `decode`: split-KV decode attention over the KV pool (`decode_attention`), and its variant from a
  decode step's projected q/k/v rows with RoPE and the new K/V's cache write inside the kernel
  (`decode_attention_rope`); both over a paged cache too (`paged_decode_attention`,
  `paged_decode_attention_rope`: pages of BS positions, a block table row per session), and over an
  8-bit paged cache with a scale per position and head (the ``_q8`` ops, `models.kv_quant`);
- `prefill`: causal flash attention of a prefill chunk over its pool row, in place (`prefill_attention`),
  or over its pages (`paged_prefill_attention`, `paged_prefill_attention_q8` for an 8-bit cache);
- `linear`: the small linear of a decode step's few rows, with the RMSNorm before it and SwiGLU or a
  residual add after it folded in (`small_linear`), reading a packed (quantized) weight as well
  (``packed=``: `packed_linear`, each tile dequantized in the kernel);
- `deltanet`: Qwen3.5's gated DeltaNet decode step (conv window, gates, delta rule, gated norm) in one kernel
  (`deltanet_decode`), and a prefill's chunk-to-chunk recurrence in another (`deltanet_chunk_scan`), their source
  in `deltanet_triton`;
- `moe`: a MoE decode step's routed experts grouped by expert, each chosen expert read once (`moe_routed`; off,
  `moe.ENABLED`: it wins from 16 rows only), its source in `moe_triton`;
- `dequant`: a packed weight dequantized for a prefill chunk's cuBLAS GEMM (`dequantize`);
- `linear_triton`: the Triton source of both (one packed-tile dequantization), imported on first launch;
- `tiles`: every tile table and tiling constant of the three (and of `native`);
- `native`: CUDA C++ kernels as ``torch.ops.onecopy_native`` ops (the 8-bit decode attention; the packed
  int4 / int8 projections of tile-ordered weights and the FP8 GEMV, `models.packed` calls them), built with
  nvcc on first use; the ``_q8`` decode calls below take them where they serve the shapes (``native=``);
- `ops`: the op definitions (once, at import of this package, where Triton and CUDA are usable),
  `available`, and the calls above.

Importing this package needs neither Triton nor CUDA (the ops are then not defined, and `available`
is False); the kernels are built on their first launch. On CPU the models use
plain torch ops instead (`models.attention`, `models.projections`); `available` says which.
The ``launch_*`` functions run one kernel with explicit tiles, outside any op (the benchmarks).
"""

from .decode import launch_decode, launch_decode_paged
from .dequant import launch_dequantize
from .linear import Norm, PackedArgs, launch_linear
from .deltanet import launch_deltanet_chunk_scan, launch_deltanet_decode
from .moe import launch_moe_routed
from .ops import (available, decode_attention, decode_attention_rope, deltanet_chunk_scan, deltanet_decode, dequantize,
                  moe_routed, paged_decode_attention,
                  paged_decode_attention_q8, paged_decode_attention_rope, paged_decode_attention_rope_q8,
                  paged_prefill_attention, paged_prefill_attention_q8, prefill_attention, small_linear)
from .prefill import launch_prefill, launch_prefill_paged
from .tiles import (BLOCK_N, INVARIANT_ROWS, PREFILL_TILES, SMALL_LINEAR_ROWS, SMEM_BUDGET, SPLIT_MAX, n_splits,
                    packed_linear_tiles, prefill_tiles, small_linear_programs, small_linear_tiles)

__all__ = ["BLOCK_N", "INVARIANT_ROWS", "Norm", "PREFILL_TILES", "PackedArgs", "SMALL_LINEAR_ROWS", "SMEM_BUDGET", "SPLIT_MAX",
           "available", "decode_attention", "decode_attention_rope", "deltanet_chunk_scan", "deltanet_decode", "dequantize",
           "launch_decode", "launch_decode_paged", "launch_deltanet_chunk_scan", "launch_deltanet_decode",
           "launch_moe_routed", "moe_routed",
           "launch_dequantize", "launch_linear", "launch_prefill", "launch_prefill_paged", "n_splits", "packed_linear_tiles",
           "paged_decode_attention", "paged_decode_attention_q8", "paged_decode_attention_rope",
           "paged_decode_attention_rope_q8", "paged_prefill_attention", "paged_prefill_attention_q8", "prefill_attention",
           "prefill_tiles", "small_linear", "small_linear_programs", "small_linear_tiles"]
