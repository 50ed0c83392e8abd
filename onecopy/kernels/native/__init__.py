"""CUDA kernels written in CUDA C++ rather than Triton, as the ``torch.ops.onecopy_native`` ops.

Two families: decode attention over an 8-bit paged KV cache (`decode_q8.cu`), and packed projections:
`packed_linear.cu` for a decode step's few rows (int4 / int8 weights in the tile order the export writes,
`models.mma_order`, and FP8 weights for up to 8 or 16 rows) and `packed_gemm.cu` for many (a wide decode step, a
prefill chunk); the comments there say why they are not Triton. AOTInductor cannot embed
a CUDA C++ kernel the way it embeds Triton's, so a package that uses these ops calls them by name (its proxy
executor) and the process must have this library loaded before the package is: `load` builds it for the
device in hand (nvcc and a C++ compiler that links libstdc++ dynamically, `toolchain.pick_cxx`; about 30 s
the first time, then cached under torch's extensions folder and only loaded) and registers the ops;
`runtime.method.Method` calls it for the methods whose manifest entry lists `LIBRARY` in ``native_ops``.

`supported` (the decode attention), `linear_serves` and `fp8_serves` (the projections) say whether the
device and shapes take a kernel; otherwise the models keep the
Triton op (`kernels.ops`), so a bundle exported where this library cannot build still works.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from ...layouts import MMA_LAYOUT_IDS

LIBRARY = "onecopy_native"
_SOURCES = ("ops.cpp", "decode_q8.cu", "packed_linear.cu", "packed_gemm.cu", "packed_wgmma.cu")
# Build-time variants of the kernels for A/B runs on the GPU machine ("NAME=VALUE,NAME=VALUE": C++ macros such as
# ONECOPY_FP8_MAX_ROWS); each distinct value builds its own library. Read once, at import: a process has one build.
DEFINES: dict[str, str] = dict(d.split("=", 1) for d in os.environ.get("ONECOPY_NATIVE_DEFINES", "").split(",") if "=" in d)
KERNEL_MAX_ROWS = 32  # kKernelMaxRows: the packed-projection op's GEMV rows (more: the packed GEMM, or cuBLAS)
# kFp8MaxRows: the GEMV's rows for FP8 weights of at most FP8_NARROW_N outputs (8 for wider ones); the ops run
# cuBLAS's FP8 GEMM for more (`fp8_gemv_rows`)
FP8_MAX_ROWS = int(DEFINES.get("ONECOPY_FP8_MAX_ROWS", 16))
FP8_WIDE_MAX_ROWS, FP8_NARROW_N = 8, 8192  # kFp8WideMaxRows, kFp8NarrowN
# Whether traced or eager projections may call these kernels (the KV decode has its own switch, the model's
# ``native_kernels``): the export sets it for the methods it traces (``native_kernels=False`` keeps Triton and
# cuBLAS, the comparison). Per context, not per process.
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("onecopy_native_kernels", default=True)


@contextlib.contextmanager
def use(enabled: bool) -> Iterator[None]:
    """While active, the projections take these kernels where they serve (``enabled``) or never."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def _buildable() -> bool:
    home = _cuda_home()
    return loaded() or shutil.which("nvcc") is not None or (home is not None and os.path.exists(f"{home}/bin/nvcc"))


def linear_serves(device: torch.device | str) -> bool:
    """True when the packed-projection kernel can run on ``device``: CUDA sm_80+, the library buildable, enabled."""
    device = torch.device(device)
    return (_ENABLED.get() and device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (8, 0) and _buildable())


def fp8_serves(x: torch.Tensor) -> bool:
    """True when `fp8_linear` takes x's rows: bf16 or fp16 on a CUDA sm_89+ device (FP8 tensor cores)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and linear_serves(x.device)
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def fp8_gemv_rows(n: int) -> int:
    """Rows the FP8 GEMV takes for a weight of ``n`` outputs (packed_linear.h's fp8_gemv_rows): more rows go to
    cuBLAS's FP8 GEMM, as rows quantized to e4m3."""
    return FP8_MAX_ROWS if n <= FP8_NARROW_N else FP8_WIDE_MAX_ROWS


def packed_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                  layout: int, group: int, residual: torch.Tensor | None = None, glu: bool = False,
                  norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                  invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's rows x [M, K] (bf16) times a tile-ordered packed weight (``layout``:
    layouts.MMA_LAYOUT_IDS) or an FP8 one as stored (layouts.F8R_NATIVE_ID, ``group`` its K: up to
    `fp8_gemv_rows` rows the GEMV on bf16 rows, more the rows quantized to e4m3 for cuBLAS's FP8 GEMM between the
    two fold kernels below; sm_89+, no ``invariant``), with the folds of `kernels.small_linear` (``norm`` =
    (weight, partial sums of squares of x's rows [M, P], eps) before, SwiGLU of a gate/up weight or a residual add after). Returns
    the output [M, N'] and its rows' sums of squares per 16 outputs [M, N' / 16] (for the next norm).
    With ``invariant`` the GEMV kernel at any number of rows (a row's bits then never depend on the batch);
    otherwise on Hopper from 33 to 512 rows the warpgroup-MMA kernel (`packed_wgmma`) between a norm kernel and a
    kernel of the other folds where it serves the weight (N and K multiples of 128); else past 8 rows the packed
    GEMM with the same folds where it serves the weight (up to 64 rows; weights of many output blocks, and on
    Hopper past 16 rows weights of few, their K split over a cluster of CTAs), else the GEMV up to
    `KERNEL_MAX_ROWS` rows and past that the weight unpacked for cuBLAS's GEMM between the same two kernels."""
    load()
    nw, ss, eps = norm if norm is not None else (None, None, 0.0)
    return torch.ops.onecopy_native.packed_linear(x, qweight, scales, mins, residual, nw, ss, eps, glu, layout, group,
                                                  invariant)


def packed_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, layout: int,
                group: int) -> torch.Tensor:
    """x [M, K] (bfloat16) times a tile-ordered packed weight [N, K], any M: on Hopper from 33 to 512 rows the
    warpgroup-MMA kernel (`packed_wgmma`) where it serves the weight; else the packed GEMM (each weight fragment
    dequantized in bf16 once per 64 rows) up to 64 rows for weights of at least half as many 256-output blocks as
    the GPU has SMs; else the weight unpacked for cuBLAS."""
    load()
    return torch.ops.onecopy_native.packed_gemm(x, qweight, scales, mins, layout, group)


def packed_wgmma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, layout: int,
                 group: int, block_rows: int = 0) -> torch.Tensor:
    """x [M, K] (bfloat16) times a tile-ordered packed weight [N, K] on Hopper's warpgroup MMA (`packed_wgmma.cu`:
    compute capability 9.0, N and K multiples of 128), the weight dequantized in registers, never written in bf16.
    `packed_gemm` and `packed_linear` take it for the rows where it is fastest; `block_rows` (64, 128 or 256 x rows a
    CTA; 0 lets the kernel pick) is for the tests and benchmarks."""
    load()
    return torch.ops.onecopy_native.packed_wgmma(x, qweight, scales, mins, layout, group, block_rows)


def unpack(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, layout: int, group: int,
           dtype: torch.dtype) -> torch.Tensor:
    """A tile-ordered packed weight as a float [N, K] in ``dtype`` (`models.packed.dequantize`'s arithmetic)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"unpack writes bfloat16 or float16, not {dtype}")
    load()
    return torch.ops.onecopy_native.unpack_weight(qweight, scales, mins, layout, group, dtype == torch.float16)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] times an e4m3 weight [N, K] with float32 scales (N of them), in x's dtype: up to `fp8_gemv_rows`
    bf16 rows the packed GEMV (bf16 rows against the exact bf16 of each e4m3 value, the scale after the sums);
    more (or fp16 rows) quantized to e4m3 (`models.packed.quantize_rows`) for cuBLAS's FP8 GEMM."""
    load()
    return torch.ops.onecopy_native.fp8_linear(x, w, scales.reshape(-1))


def fp8_glu_linear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`fp8_linear` of the SwiGLU rows silu(x[:, :K]) * x[:, K:] of a gate/up output x [M, 2K] and an e4m3 weight
    [N, K]: the rows made and quantized in one kernel (up to `fp8_gemv_rows` rows made in x's dtype for the GEMV).
    `models.packed.fp8_glu_linear` (an FP8 model's SwiGLU, `layers.swiglu`) calls it."""
    load()
    return torch.ops.onecopy_native.fp8_glu_linear(x, w, scales.reshape(-1))


def supported(head_dim: int, group: int, kv_dtype: torch.dtype, device: torch.device | str = "cuda") -> bool:
    """True when the 8-bit decode kernel serves this shape on ``device``: head_dim 64 or 128, up to 8 query
    heads per KV head, sm_80+ (fp8 values: sm_89+), nvcc on the PATH (or the library already loaded)."""
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        return False
    if head_dim not in (64, 128) or not 1 <= group <= 8:
        return False
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    need = (8, 9) if kv_dtype == torch.float8_e4m3fn else (8, 0)
    if (major, minor) < need:
        return False
    return _buildable()


def loaded() -> bool:
    """True once the ops are registered in this process."""
    return hasattr(torch.ops, LIBRARY) and hasattr(getattr(torch.ops, LIBRARY), "paged_decode_q8")


def _cuda_home() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME


@functools.cache
def load() -> None:
    """Build (once per machine and source version) and load the library, and register the ops' fake
    implementations for export. Raises ToolchainError with the compiler's message if it cannot build."""
    from torch.utils.cpp_extension import load as build

    from ...errors import ToolchainError
    from ...toolchain import build_environment, pick_cxx

    here = Path(__file__).parent
    major, minor = torch.cuda.get_device_capability()
    suffix = "a" if (major, minor) == (9, 0) else ""  # sm_90a: the H100 / H200's wgmma (packed_wgmma.cu)
    arch = f"{major}{minor}{suffix}"
    cxx = pick_cxx()
    flags = [f"-D{k}={v}" for k, v in sorted(DEFINES.items())]
    variant = "".join(f"_{k.lower()}{v}" for k, v in sorted(DEFINES.items()))  # its own build folder
    try:
        with build_environment(CXX=cxx, NVCC_CCBIN=cxx, TORCH_CUDA_ARCH_LIST=f"{major}.{minor}{suffix}"):
            build(name=f"{LIBRARY}_sm{arch}{variant}", sources=[str(here / s) for s in _SOURCES],
                  is_python_module=False, extra_cflags=["-O3", *flags],
                  extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", *flags],
                  extra_include_paths=[str(here)], verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        raise ToolchainError(f"the native CUDA kernels ({', '.join(_SOURCES)}) did not build: {str(e)[-600:]}; "
                             "install the CUDA toolkit (nvcc) that matches torch, or export without them "
                             "(--no-native-kernels, export(native_kernels=False))") from e
    _register_fakes()


def _register_fakes() -> None:
    def heads_out(q: torch.Tensor, k_pool: torch.Tensor, rope: bool) -> torch.Tensor:
        d, hkv = k_pool.shape[3], k_pool.shape[1]
        hq = q.shape[1] // d - 2 * hkv if rope else q.shape[1]
        return q.new_empty((q.shape[0], hq, d))

    @torch.library.register_fake(f"{LIBRARY}::paged_decode_q8")
    def _(q, k_pool, v_pool, k_scale, v_scale, table, rows, lengths, splits, block):
        return heads_out(q, k_pool, False)

    @torch.library.register_fake(f"{LIBRARY}::paged_decode_rope_q8")
    def _(qkv, cos, sin, k_pool, v_pool, k_scale, v_scale, table, rows, lengths, splits, block):
        return heads_out(qkv, k_pool, True)

    @torch.library.register_fake(f"{LIBRARY}::packed_linear")
    def _(x, qweight, scales, mins, residual, norm_weight, ss, eps, glu, layout, group, invariant=False):
        n_out = qweight.shape[0] // 2 if glu else qweight.shape[0]
        return x.new_empty((x.shape[0], n_out)), x.new_empty((x.shape[0], n_out // 16), dtype=torch.float32)

    @torch.library.register_fake(f"{LIBRARY}::packed_gemm")
    def _(x, qweight, scales, mins, layout, group):
        return x.new_empty((x.shape[0], qweight.shape[0]))

    @torch.library.register_fake(f"{LIBRARY}::packed_wgmma")
    def _(x, qweight, scales, mins, layout, group, block_rows=0):
        return x.new_empty((x.shape[0], qweight.shape[0]))

    @torch.library.register_fake(f"{LIBRARY}::unpack_weight")
    def _(qweight, scales, mins, layout, group, half):
        per_byte = 1 if layout == MMA_LAYOUT_IDS["q8s_mma"] else 2
        return qweight.new_empty((qweight.shape[0], qweight.shape[1] * per_byte),
                                 dtype=torch.float16 if half else torch.bfloat16)

    @torch.library.register_fake(f"{LIBRARY}::fp8_linear")
    def _(x, w, ws):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake(f"{LIBRARY}::fp8_glu_linear")
    def _(x, w, ws):
        return x.new_empty((x.shape[0], w.shape[0]))
