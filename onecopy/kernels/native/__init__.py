"""CUDA kernels written in CUDA C++ rather than Triton, as the ``torch.ops.onecopy_native`` ops.

Today one family: decode attention over an 8-bit paged KV cache (`decode_q8.cu`; the module comment there
says why it is not Triton). AOTInductor cannot embed a CUDA C++ kernel the way it embeds Triton's, so a
package that uses these ops calls them by name (its proxy executor) and the process must have this
library loaded before the package is: `load` builds it for the device in hand (nvcc and a C++ compiler
that links libstdc++ dynamically, `toolchain.pick_cxx`; about 30 s the first time, then cached
under torch's extensions folder and only loaded) and registers the ops; `runtime.method.Method` calls it
for the methods whose manifest entry lists `LIBRARY` in ``native_ops``.

`supported` says whether an op's shapes and the device take the kernel; otherwise the models keep the
Triton op (`kernels.ops`), so a bundle exported where this library cannot build still works.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch

LIBRARY = "onecopy_native"
_SOURCES = ("ops.cpp", "decode_q8.cu")


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
    home = _cuda_home()
    return loaded() or shutil.which("nvcc") is not None or (home is not None and os.path.exists(f"{home}/bin/nvcc"))


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
    arch = f"{major}{minor}"
    cxx = pick_cxx()
    try:
        with build_environment(CXX=cxx, NVCC_CCBIN=cxx, TORCH_CUDA_ARCH_LIST=f"{major}.{minor}"):
            build(name=f"{LIBRARY}_sm{arch}", sources=[str(here / s) for s in _SOURCES], is_python_module=False,
                  extra_cflags=["-O3"], extra_cuda_cflags=["-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
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
