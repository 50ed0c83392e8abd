"""The ``torch.ops.onecopy`` kernel ops, defined once when this package is imported, and the calls models make.

AOTInductor packages embed these ops by name and schema: keep both as they are. Each op launches
its family's kernels (`decode`, `prefill`, `linear`) through ``wrap_triton``, so that export traces
into the Triton kernels and the compiled package carries them.

The ops are defined at import, before any trace (an op cannot be defined while a ``torch.cond``
branch that calls it is being traced), and only where `available` says that Triton and a CUDA device
are usable: defining one imports Triton and torch._inductor (torch inspects the op's body), which a
CPU-only process never needs. Where they are not defined no model calls them: every caller checks
`available` first.
"""

from __future__ import annotations

import torch

from .decode import launch_decode, launch_decode_paged
from .deltanet import launch_deltanet_chunk_scan, launch_deltanet_decode
from .moe import launch_moe_routed
from .dequant import launch_dequantize
from .linear import Norm, PackedArgs, launch_linear
from .prefill import launch_prefill, launch_prefill_paged
from .tiles import (SMALL_LINEAR_ROWS, native_decode_splits, packed_linear_tiles, prefill_tiles,
                    small_linear_tiles)


def available() -> bool:
    """True when Triton and a CUDA device are usable in this process."""
    if not torch.cuda.is_available():  # first: a CPU-only process with Triton installed never imports it
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _define_ops() -> None:
    """Define the ``torch.ops.onecopy`` kernel ops (called once, below)."""
    from torch.library import triton_op

    # The decode ops' ``invariant``: a row's splits depend on its length alone (the batch-invariant decode);
    # otherwise on the batch size too (`tiles.decode_splits`: fewer, longer splits for many rows).
    @triton_op("onecopy::decode_attention", mutates_args=())
    def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                         lengths: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """q [B, Hq, D] against rows[b] of the pools [P, Hkv, S, D], positions < lengths[b]; -> [B, Hq, D]."""
        return launch_decode(q, None, k_pool, v_pool, rows, lengths, invariant)

    @triton_op("onecopy::decode_attention_rope", mutates_args=("k_pool", "v_pool"))
    def decode_attention_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                              v_pool: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                              invariant: bool = False) -> torch.Tensor:
        """A decode step's projected qkv [B, (Hq + 2 Hkv) D]: RoPE (cos, sin [B, D]) on q and k, the new k
        and v cached in rows[b] of the pools at position lengths[b] - 1, q against positions < lengths[b];
        -> [B, Hq, D]."""
        qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()  # one row stride for both (views of [B, 1, 1, D] already are)
        return launch_decode(qkv, (cos, sin), k_pool, v_pool, rows, lengths, invariant)

    @triton_op("onecopy::prefill_attention", mutates_args=())
    def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                          positions: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] at increasing ``positions`` [T] against row rows[0] of the pools, causal; -> [T, Hq, D].
        Batched: q [B, T, Hq, D] at ``positions`` [B, T], chunk b against row rows[b]; -> [B, T, Hq, D]."""
        if q.stride(-1) != 1:
            q = q.contiguous()
        positions = positions.contiguous()
        return launch_prefill(q, k_pool, v_pool, rows, positions, prefill_tiles(q.shape[-1]))

    # Paged KV cache: pools [NB, Hkv, BS, D] of NB pages of BS positions (BS a power of two >= 16), and a
    # block table [P, NBMAX] (int64): position p of the session in table row r is in page table[r, p // BS].
    @triton_op("onecopy::paged_decode_attention", mutates_args=())
    def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                               rows: torch.Tensor, lengths: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """`decode_attention` over pages: q [B, Hq, D] against table row rows[b], positions < lengths[b];
        -> [B, Hq, D], bit for bit the non-paged op's over the same logical rows of NBMAX * BS positions."""
        table = table if table.stride(-1) == 1 else table.contiguous()
        return launch_decode_paged(q, None, k_pool, v_pool, table, rows, lengths, invariant=invariant)

    @triton_op("onecopy::paged_decode_attention_rope", mutates_args=("k_pool", "v_pool"))
    def paged_decode_attention_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                                    v_pool: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                                    lengths: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """`decode_attention_rope` over pages: the new k and v cached at position lengths[b] - 1 of table row
        rows[b] (in page table[rows[b], (lengths[b] - 1) // BS]); -> [B, Hq, D]."""
        qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        table = table if table.stride(-1) == 1 else table.contiguous()
        return launch_decode_paged(qkv, (cos, sin), k_pool, v_pool, table, rows, lengths, invariant=invariant)

    @triton_op("onecopy::paged_prefill_attention", mutates_args=())
    def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                                rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`prefill_attention` over pages: q [T, Hq, D] at increasing ``positions`` [T] against table row
        rows[0], causal; -> [T, Hq, D] (batched as `prefill_attention`)."""
        if q.stride(-1) != 1:
            q = q.contiguous()
        positions = positions.contiguous()
        table = table if table.stride(-1) == 1 else table.contiguous()
        return launch_prefill_paged(q, k_pool, v_pool, table, rows, positions, prefill_tiles(q.shape[-1]))

    # An 8-bit paged cache (models.kv_quant): int8 or fp8 pools and their float32 scales [NB, Hkv, BS], one
    # per position and head. New ops, not new arguments: bundles exported before them keep their schemas.
    @triton_op("onecopy::paged_decode_attention_q8", mutates_args=())
    def paged_decode_attention_q8(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor,
                                  v_scale: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                                  lengths: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        """`paged_decode_attention` over an 8-bit cache, each value times its position's scale as read."""
        table = table if table.stride(-1) == 1 else table.contiguous()
        return launch_decode_paged(q, None, k_pool, v_pool, table, rows, lengths, (k_scale, v_scale), invariant=invariant)

    @triton_op("onecopy::paged_decode_attention_rope_q8", mutates_args=("k_pool", "v_pool", "k_scale", "v_scale"))
    def paged_decode_attention_rope_q8(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                                       v_pool: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                                       table: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                                       invariant: bool = False) -> torch.Tensor:
        """`paged_decode_attention_rope` over an 8-bit cache: the new k and v quantized (a scale each per
        head) as they are cached, and attended as the cache will hold them."""
        qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        table = table if table.stride(-1) == 1 else table.contiguous()
        return launch_decode_paged(qkv, (cos, sin), k_pool, v_pool, table, rows, lengths, (k_scale, v_scale),
                                   invariant=invariant)

    @triton_op("onecopy::paged_prefill_attention_q8", mutates_args=())
    def paged_prefill_attention_q8(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor,
                                   v_scale: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                                   positions: torch.Tensor) -> torch.Tensor:
        """`paged_prefill_attention` over an 8-bit cache, each value times its position's scale as read."""
        if q.stride(-1) != 1:
            q = q.contiguous()
        positions = positions.contiguous()
        table = table if table.stride(-1) == 1 else table.contiguous()
        return launch_prefill_paged(q, k_pool, v_pool, table, rows, positions, prefill_tiles(q.shape[-1]),
                                    (k_scale, v_scale))

    @triton_op("onecopy::small_linear", mutates_args=())
    def small_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, glu: bool,
                     norm_weight: torch.Tensor | None, norm_ss: torch.Tensor | None,
                     eps: float, block_m: int, invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """[M, K] rows -> ([M, N] (N/2 with ``glu``), partial sums of squares); see `linear`'s docstring.
        A row's result depends only on that row: fixed tiles, K reduced in one order, whatever M."""
        x = x if x.stride(-1) == 1 else x.contiguous()
        residual = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
        norm = None if norm_weight is None or norm_ss is None else (norm_weight, norm_ss.contiguous(), eps)
        n_out = weight.shape[0] // 2 if glu else weight.shape[0]
        return launch_linear(x, weight, residual, glu, small_linear_tiles(n_out, glu, invariant), norm, block_m)

    @triton_op("onecopy::packed_linear", mutates_args=())
    def packed_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                      layout: int, group: int, residual: torch.Tensor | None, glu: bool,
                      norm_weight: torch.Tensor | None, norm_ss: torch.Tensor | None, eps: float, block_m: int,
                      invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`small_linear` of a packed weight (models.packed: values ``qweight``, float32 ``scales`` and
        ``mins`` per ``group`` values, ``layout`` its LAYOUT_IDS number), each tile dequantized in fp32 as
        read and rounded to x's dtype. Not bit for bit `small_linear` of the dequantized weight (measured on
        the H100), but a row's bits depend only on the tiles and the rows per program."""
        x = x if x.stride(-1) == 1 else x.contiguous()
        residual = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
        norm = None if norm_weight is None or norm_ss is None else (norm_weight, norm_ss.contiguous(), eps)
        n_out = qweight.shape[0] // 2 if glu else qweight.shape[0]
        tiles = small_linear_tiles(n_out, glu, True) if invariant else packed_linear_tiles(n_out, glu, layout)
        return launch_linear(x, qweight, residual, glu, tiles, norm, block_m, (scales, mins, layout, group))

    @triton_op("onecopy::deltanet_decode", mutates_args=("conv_pool", "rec_pool"))
    def deltanet_decode(proj: torch.Tensor, conv_pool: torch.Tensor, conv_w: torch.Tensor, rec_pool: torch.Tensor,
                        a_log: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor, rows: torch.Tensor,
                        positions: torch.Tensor, n_k_heads: int, eps: float) -> torch.Tensor:
        """A gated DeltaNet decode step from the input projection ``proj`` [N, P] to the gated, normed output
        [N, nv dv], the conv and recurrent states of ``rows`` updated in place (`deltanet`)."""
        return launch_deltanet_decode(proj, conv_pool, conv_w, rec_pool, a_log, dt_bias, norm_w, rows, positions,
                                      n_k_heads, eps)

    @triton_op("onecopy::deltanet_chunk_scan", mutates_args=())
    def deltanet_chunk_scan(new_values: torch.Tensor, k_cumdecay: torch.Tensor, q_dec: torch.Tensor,
                            k_dec: torch.Tensor, intra: torch.Tensor, chunk_decay: torch.Tensor,
                            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A DeltaNet prefill's chunk-to-chunk recurrence in one kernel: (output [H, n, C, dv], final state)."""
        return launch_deltanet_chunk_scan(new_values, k_cumdecay, q_dec, k_dec, intra, chunk_decay, state)

    @triton_op("onecopy::moe_routed", mutates_args=())
    def moe_routed(x: torch.Tensor, idx: torch.Tensor, top: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
        """A decode step's routed experts grouped by expert (`moe`): x [N, D], idx / top [N, k] -> [N, D]."""
        return launch_moe_routed(x, idx, top, gate_up, down)

    @triton_op("onecopy::dequantize", mutates_args=())
    def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, layout: int, group: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """A packed weight (models.packed: values, float32 ``scales`` and ``mins`` per ``group`` values,
        ``layout`` its LAYOUT_IDS number) as a [N, K] ``dtype`` matrix: `models.packed.dequantize`'s arithmetic."""
        return launch_dequantize(qweight, scales.contiguous(), None if mins is None else mins.contiguous(), layout,
                                 group, dtype)


if available():
    _define_ops()


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    """See the op: a prefill chunk's causal attention over its pool row, read in place (CUDA only)."""
    return torch.ops.onecopy.prefill_attention(q, k_pool, v_pool, rows, positions)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                     lengths: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """See the op: one query per row against that row's first ``lengths[b]`` cached positions (CUDA only)."""
    return torch.ops.onecopy.decode_attention(q, k_pool, v_pool, rows, lengths, invariant)


def decode_attention_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                          v_pool: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                          invariant: bool = False) -> torch.Tensor:
    """See the op: a decode step's attention from its projected rows ``qkv`` [B, (Hq + 2 Hkv) D], with
    RoPE (cos, sin [B, D]) and the write of the new k/v at ``positions`` [B] folded in (CUDA only)."""
    return torch.ops.onecopy.decode_attention_rope(qkv, cos, sin, k_pool, v_pool, rows, positions + 1, invariant)


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                            rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """See the op: `prefill_attention` over a paged cache, the session's pages named by table row rows[0]
    (CUDA only)."""
    return torch.ops.onecopy.paged_prefill_attention(q, k_pool, v_pool, table, rows, positions)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                           rows: torch.Tensor, lengths: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """See the op: `decode_attention` over a paged cache, row b's pages named by table row rows[b] (CUDA only)."""
    return torch.ops.onecopy.paged_decode_attention(q, k_pool, v_pool, table, rows, lengths, invariant)


def paged_decode_attention_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                                v_pool: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                                positions: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """See the op: `decode_attention_rope` over a paged cache, the new k/v written at ``positions`` [B] into
    the pages that table rows rows[b] name (CUDA only)."""
    return torch.ops.onecopy.paged_decode_attention_rope(qkv, cos, sin, k_pool, v_pool, table, rows, positions + 1,
                                                         invariant)


def paged_decode_attention_q8(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor,
                              v_scale: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                              lengths: torch.Tensor, invariant: bool = False, native: bool = True) -> torch.Tensor:
    """See the op: `paged_decode_attention` over an 8-bit cache with its scale pools (CUDA only). ``native``:
    the CUDA C++ kernel (`kernels.native`) where it serves these shapes, else the Triton op."""
    if native and _native_serves(q.shape[-1], q.shape[1] // k_pool.shape[1], k_pool):
        return torch.ops.onecopy_native.paged_decode_q8(q, k_pool, v_pool, k_scale, v_scale, table, rows, lengths,
                                                       *_native_splits(q.shape[0], k_pool, table, invariant))
    return torch.ops.onecopy.paged_decode_attention_q8(q, k_pool, v_pool, k_scale, v_scale, table, rows, lengths,
                                                       invariant)


def paged_decode_attention_rope_q8(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                                   v_pool: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                                   table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                                   invariant: bool = False, native: bool = True) -> torch.Tensor:
    """See the op: `paged_decode_attention_rope` over an 8-bit cache, the new k/v quantized as written (CUDA only).
    ``native``: as `paged_decode_attention_q8`."""
    d, hkv = k_pool.shape[3], k_pool.shape[1]
    hq = qkv.shape[1] // d - 2 * hkv
    if native and _native_serves(d, hq // hkv, k_pool):
        return torch.ops.onecopy_native.paged_decode_rope_q8(
            qkv if qkv.stride(-1) == 1 else qkv.contiguous(), cos.contiguous(), sin.contiguous(), k_pool, v_pool,
            k_scale, v_scale, table, rows, positions + 1, *_native_splits(qkv.shape[0], k_pool, table, invariant))
    return torch.ops.onecopy.paged_decode_attention_rope_q8(qkv, cos, sin, k_pool, v_pool, k_scale, v_scale, table,
                                                            rows, positions + 1, invariant)


def _native_serves(head_dim: int, group: int, k_pool: torch.Tensor) -> bool:
    """True when the CUDA C++ 8-bit decode kernel takes these shapes here; loads (builds) it then."""
    from . import native

    if not native.supported(head_dim, group, k_pool.dtype, k_pool.device):
        return False
    native.load()
    return True


def _native_splits(batch, k_pool: torch.Tensor, table: torch.Tensor, invariant: bool) -> tuple:
    """(splits, block) of the native kernel (`tiles.native_decode_splits`) on this device."""
    sms = torch.cuda.get_device_properties(k_pool.device).multi_processor_count
    return native_decode_splits(batch, k_pool.shape[1], table.shape[1] * k_pool.shape[2], sms, invariant)


def paged_prefill_attention_q8(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor,
                               v_scale: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                               positions: torch.Tensor) -> torch.Tensor:
    """See the op: `paged_prefill_attention` over an 8-bit cache with its scale pools (CUDA only)."""
    return torch.ops.onecopy.paged_prefill_attention_q8(q, k_pool, v_pool, k_scale, v_scale, table, rows, positions)


def deltanet_decode(proj: torch.Tensor, conv_pool: torch.Tensor, conv_w: torch.Tensor, rec_pool: torch.Tensor,
                    a_log: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor, rows: torch.Tensor,
                    positions: torch.Tensor, n_k_heads: int, eps: float) -> torch.Tensor:
    """See the op: Qwen3.5's gated DeltaNet decode step in one kernel, proj [N, P] -> [N, nv dv] (CUDA only)."""
    return torch.ops.onecopy.deltanet_decode(proj, conv_pool, conv_w, rec_pool, a_log, dt_bias, norm_w, rows,
                                             positions, n_k_heads, eps)


def deltanet_chunk_scan(new_values: torch.Tensor, k_cumdecay: torch.Tensor, q_dec: torch.Tensor,
                        k_dec: torch.Tensor, intra: torch.Tensor, chunk_decay: torch.Tensor,
                        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See the op: a DeltaNet prefill's state hand-over from chunk to chunk in one kernel (CUDA only)."""
    return torch.ops.onecopy.deltanet_chunk_scan(new_values, k_cumdecay, q_dec, k_dec, intra, chunk_decay, state)


def moe_routed(x: torch.Tensor, idx: torch.Tensor, top: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """See the op: a decode step's routed experts, each chosen expert's weights read once (CUDA only)."""
    return torch.ops.onecopy.moe_routed(x, idx, top, gate_up, down)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, layout: int, group: int,
               dtype: torch.dtype) -> torch.Tensor:
    """See the op: a packed weight dequantized to a [N, K] ``dtype`` matrix in one kernel (CUDA only)."""
    return torch.ops.onecopy.dequantize(qweight, scales, mins, layout, group, dtype)


def small_linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
                 glu: bool = False, norm: Norm | None = None, block_m: int = SMALL_LINEAR_ROWS,
                 invariant: bool = False, packed: PackedArgs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the op: ``x`` [M, K] through ``weight`` [N, K] in one kernel (CUDA only; batch-invariant),
    with RMSNorm before it (``norm``: its weight, the partial sums of squares of ``x``'s rows [M, P] that
    the kernel producing ``x`` returned, eps) and SwiGLU or a residual add after it. Returns the output
    [M, N'] and its rows' partial sums of squares [M, `small_linear_programs`] (fp32), for a norm after.
    ``block_m`` rows per program: `SMALL_LINEAR_ROWS` (fastest for a few rows) or `INVARIANT_ROWS`;
    ``invariant``: the tiles of the batch-invariant decode (one BLOCK_N and BLOCK_K for both).
    ``packed`` (scales, mins, layout number, group): ``weight`` is a packed weight's values, read packed
    (`packed_linear`; its tiles `packed_linear_tiles` whatever ``block_m``; unlike a float weight's, a
    row's bits differ between 16- and 64-row programs, so the models run packed weights in 16-row
    programs at every batch size). Callable inside a ``torch.cond`` branch: the op was defined at import."""
    nw, ss, eps = norm if norm is not None else (None, None, 0.0)
    if packed is not None:
        scales, mins, layout, group = packed
        return torch.ops.onecopy.packed_linear(x, weight, scales, mins, layout, group, residual, glu, nw, ss, eps,
                                               block_m, invariant)
    return torch.ops.onecopy.small_linear(x, weight, residual, glu, nw, ss, eps, block_m, invariant)
