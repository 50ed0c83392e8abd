"""Every tile table and tiling constant of the CUDA kernels, in one place (no Triton needed to read them).

The numbers are measurements on the H200 (benchmarks/*.py, results in benchmarks/results/); the
models read `SMALL_LINEAR_ROWS` too, to pick between the small-linear kernel and cuBLAS.
"""

from __future__ import annotations

BLOCK_N = 64  # cache positions per inner step
# The grid has one program per (row, KV head) and SPLIT_MAX cache positions of the pool (fewer when
# the cache is shorter); each row's filled prefix is shared evenly among them in whole blocks, so a
# short context is still spread over many programs (batch 1, 1k context in a 16k pool: 16 programs of
# one block per head instead of 4 of four). A row's split depends only on its own length.
SPLIT_MAX = 256
# With many rows there are programs enough without splitting the rows: from DECODE_PROGRAMS (row, KV head)
# pairs (128 rows of 8 KV heads) a bf16 cache's default decode runs one program per pair (`decode_splits`):
# no partial results to merge, long programs that stream the cache; an 8-bit cache from DECODE_PROGRAMS_Q8
# (64 rows), where its split kernel then writes the output itself (`merged_rows`). Fewer rows keep every
# split of the table (at 16-32 rows of the 8B shape fewer splits read slower: 0.67 -> 0.58 of copy bandwidth
# at 16 rows of 4k). The batch-invariant decode always keeps them: a row's splits then depend on its own
# length alone.
# H200, 8B shape (benchmarks/kv_attention_cuda.py, results/kv_attention_h200.json, the same run): bf16 at
# 64-256 rows of 1k 0.54-0.58 -> 0.70-0.82 of copy bandwidth, of 4k 0.81-0.85 -> 0.87-0.95, in a 16k pool.
# But whole decode steps of a 2k pool (8 layers, 1k prompts + 512 new tokens, same run, one H200) ran 64 bf16
# rows in 2.61 ms with one split per pair and 2.50-2.52 ms with every split (9 per row), 128 and 256 rows the
# same either way (results/decode_programs_8l_h200.json): so bf16 splits its rows up to 127.
DECODE_PROGRAMS = 1024
DECODE_PROGRAMS_Q8 = 512
# An 8-bit cache's positions per inner step: twice the positions for the same bytes in flight (at 64-256
# rows 0.24-0.38 -> 0.41-0.53 of copy bandwidth with one split per row; --sweep, kv_attention_sweep_h200.json).
BLOCK_N_Q8 = 128
# The CUDA C++ 8-bit decode (`kernels.native`, decode_q8.cu): a split's positions are a multiple of NATIVE_BLOCK
# (one 32-position step for each of a CTA's 2 warps); the default decode launches enough splits per row to
# give every SM NATIVE_CTAS_PER_SM CTAs (its register budget) when rows are few, one per row from there.
# H100, one layer of the 8B shape (results/native_decode_sweep_h100.json): 16 sessions of 1k/4k run best with
# 4 splits (0.38/0.64 of copy bandwidth; 16 splits 0.27/0.55), 64-256 sessions with 1. The batch-invariant
# decode splits a row by its length alone, in multiples of NATIVE_INVARIANT_BLOCK (a 1k row: 4 splits).
NATIVE_BLOCK = 64
NATIVE_SPLIT_MAX = 64  # positions of the pool per split at most: a short context at batch 1 spreads over all SMs
NATIVE_INVARIANT_BLOCK = 256
NATIVE_CTAS_PER_SM = 4
NATIVE_MAX_SPLITS = 256  # the native merge's bound (kMergeSplits in decode_q8.cu): longer pools get longer splits
# Prefill tiles: (query rows, key columns, warps, pipeline stages) per program, by head size.
# The fastest over a fresh 1k, a fresh 8k and a 2k-after-6k chunk on the H200
# (benchmarks/prefill_attention_cuda.py, benchmarks/results/prefill_attention_h200.json).
PREFILL_TILES = {64: (64, 64, 4, 3), 128: (64, 64, 4, 3), 256: (64, 32, 4, 2)}
# small_linear: the rows one program serves (the tensor-core tile's height). A call takes any number of
# rows, a block of this many per program, each row's arithmetic the same wherever it sits (batch
# invariance); the default decode sends more than this many rows to cuBLAS (`projections.by_rows`).
SMALL_LINEAR_ROWS = 16
# Rows per program past SMALL_LINEAR_ROWS in the batch-invariant decode (`invariant`). At 64 rows a program
# reads the 8B shape's weights as fast as cuBLAS (0.9-1.25x per projection, benchmarks/gemv_cuda.py
# --block-m 64, benchmarks/results/gemv_bm64_h200.json); programs of 16 rows re-read them (0.43-0.66x,
# gemv_rows16_h200.json), and so did four 16-row dots per program (gemv_sub4_h200.json).
# Up to SMALL_LINEAR_ROWS rows it keeps 16-row programs (faster for a few rows): a row gets the same bits
# from a 16-row and a 64-row tile with the same BLOCK_N and BLOCK_K (only its partial sums of squares
# differ: tests/gpu/test_cuda.py::test_small_linear_rows_are_independent_of_the_batch).
INVARIANT_ROWS = 64
SMEM_BUDGET = 200 * 1024  # bytes of shared memory the small-linear pipeline may take (H100/H200: 227 KiB)


def small_linear_tiles(n_out: int, glu: bool, invariant: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) for ``n_out`` output features: the fastest on the H200 per
    Llama-3-8B projection (benchmarks/gemv_cuda.py). Few outputs want long K steps to keep enough bytes
    in flight per program; gate/up reads two tiles per step. 16 rows per program:
    benchmarks/results/gemv_h200.json; ``invariant`` (the batch-invariant decode, whose 16- and 64-row
    programs must share BLOCK_N and BLOCK_K so that a row's reduction order is one): the fastest with
    64 rows per program, benchmarks/results/gemv_bm64_h200.json."""
    if invariant:
        if glu:
            return (64, 128, 4, 4)
        if n_out <= 4096:
            return (32, 256, 4, 4)
        if n_out <= 8192:
            return (64, 256, 4, 3)
        return (128, 128, 4, 4)
    if glu:
        return (32, 128, 4, 3)
    if n_out <= 4096:
        return (32, 512, 4, 4)
    if n_out <= 8192:
        return (64, 256, 4, 4)
    return (64, 128, 4, 3)


def packed_linear_tiles(n_out: int, glu: bool, layout: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) of the packed-weight small linear (`ops.packed_linear`), whatever
    the rows per program (the models run packed weights in 16-row programs). The fastest at one row on the
    H100 per Llama-3-8B projection (benchmarks/packed_gemv_cuda.py, benchmarks/results/packed_gemv_h100.json):
    the kernel is bound by the dequantization's arithmetic, not by bytes, so short rows of programs."""
    if glu:
        return (32, 256 if layout in (2, 3) else 128, 4, 3)
    if n_out <= 8192:
        return (32, 512, 4, 4)
    return (64, 256, 4, 4)


def n_splits(max_seq_len: int, split_max: int = SPLIT_MAX, block: int = BLOCK_N) -> int:
    """Programs per (row, KV head): one per ``split_max`` positions of the cache (block-rounded when shorter)."""
    return -(-max_seq_len // min(split_max, -(-max_seq_len // block) * block))


def decode_splits(rows, kv_heads: int, splits: int, programs: int = DECODE_PROGRAMS):
    """Splits launched per (row, KV head) for ``rows`` rows (an int, or the traced batch size: a SymInt, so
    that one exported decode picks per call): ``splits`` below ``programs`` (row, KV head) pairs
    (`DECODE_PROGRAMS`, or `DECODE_PROGRAMS_Q8` for an 8-bit cache), else 1."""
    import torch

    return splits - (splits - 1) * torch.sym_min(1, rows * kv_heads // programs)


def native_decode_splits(rows, kv_heads: int, positions: int, sms: int, invariant: bool) -> tuple:
    """(splits, block) of the native 8-bit decode for ``rows`` rows (an int or the traced batch size) over a
    pool of ``positions`` per row on a GPU of ``sms`` multiprocessors; see NATIVE_BLOCK."""
    import torch

    if invariant:
        return min(n_splits(positions, SPLIT_MAX, NATIVE_INVARIANT_BLOCK), NATIVE_MAX_SPLITS), NATIVE_INVARIANT_BLOCK
    most = min(n_splits(positions, NATIVE_SPLIT_MAX, NATIVE_BLOCK), NATIVE_MAX_SPLITS)
    return torch.sym_max(1, torch.sym_min(most, NATIVE_CTAS_PER_SM * sms // (rows * kv_heads))), NATIVE_BLOCK


def merged_rows(rows, splits):
    """Rows of the merge kernel's grid over an 8-bit cache: none when each row ran one split (``splits`` 1: the
    split kernel wrote the output itself, the same bits), else ``rows``. SymInt-safe like `decode_splits`;
    Triton's and AOTInductor's launchers skip an empty grid, and so does a CUDA graph captured over it.
    H200, one layer of the 8B shape, same run, 64-256 sessions: int8 and fp8 1.02-1.11x faster. Not for bf16,
    whose split kernel stays as it was: with the direct store compiled in it ran 0.73-0.82x at 64 sessions
    (512 programs; benchmarks/decode_ab_cuda.py, results/kv_merge_skip_h200.json)."""
    import torch

    return rows * torch.sym_min(1, splits - 1)


def small_linear_programs(n_out: int, glu: bool, invariant: bool = False) -> int:
    """How many partial sums of squares `small_linear` returns per row for ``n_out`` outputs."""
    return -(-n_out // small_linear_tiles(n_out, glu, invariant)[0])


def prefill_tiles(d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for head size ``d``."""
    return PREFILL_TILES.get(d, PREFILL_TILES[256] if d > 128 else PREFILL_TILES[128])  # others: the nearest
