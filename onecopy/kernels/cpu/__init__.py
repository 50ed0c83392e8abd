"""CPU kernels in C++, as the ``torch.ops.onecopy_cpu`` ops: today one, the packed (quantized) linear.

`packed_linear` multiplies float32 rows by a weight as the bundle stores it (`layouts`: q8s, q8a, q4z, q4a, a
group a multiple of 32), so a CPU bundle can keep a GGUF's quantized tensors packed: the weight store holds
the packed bytes only, and a decode step reads them once instead of dequantizing every weight into a float
copy first (`packed_linear.cpp` says how; few rows: fused dot products in an order fixed by each row, so a
row's bits never depend on the batch; many rows: dequantized once and ATen's GEMM).

The op's schema and fake implementation are defined in Python at import (export traces it with no compiler);
its CPU implementation is C++ built on first use (`load`: torch's extension builder with `toolchain.pick_cxx`,
about 20 s once per machine and source, then cached under torch's extensions folder and only loaded). A
package that calls it does so by name (its proxy executor), so `runtime.method` loads this library first
for the methods whose manifest lists `LIBRARY` in ``native_ops``.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from ...layouts import LAYOUT_IDS  # the C++ Layout enum

LIBRARY = "onecopy_cpu"
_SOURCE = Path(__file__).with_name("packed_linear.cpp")

_lib = torch.library.Library(LIBRARY, "FRAGMENT")
_lib.define("packed_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? mins, int layout, int group) -> Tensor")


@torch.library.register_fake(f"{LIBRARY}::packed_linear")
def _(x, qweight, scales, mins, layout, group):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def serves(layout: str, group: int, x: torch.Tensor) -> bool:
    """True when `packed_linear` takes this weight and these rows: a CPU float32 x, a layout it reads, a
    group that is a multiple of 32 (every GGUF block type onecopy repacks)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and layout in LAYOUT_IDS and group % 32 == 0


def packed_linear(x: torch.Tensor, layout: str, group: int, qweight: torch.Tensor, scales: torch.Tensor,
                  mins: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T`` for rows x [M, K] and the packed W [N, K] (`serves` must hold); float32 [M, N]."""
    if not isinstance(x, torch._subclasses.FakeTensor) and not torch.compiler.is_compiling():
        load()
    return torch.ops.onecopy_cpu.packed_linear(x, qweight, scales, mins, LAYOUT_IDS[layout], group)


def loaded() -> bool:
    """True once the C++ implementation is registered in this process."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{LIBRARY}::packed_linear", "CPU")


@functools.cache
def load() -> None:
    """Build (once per machine and source version) and load the C++ implementation. Raises ToolchainError with
    the compiler's message if it cannot build."""
    if loaded():
        return
    from torch.utils.cpp_extension import load as build

    from ...errors import ToolchainError
    from ...toolchain import build_environment, pick_cxx

    # -fopenmp: at::parallel_for is a header template that runs serially unless compiled with OpenMP (libgomp is
    # torch's own, already loaded under the same soname); -ffp-contract=off: the dequantization rounds s * q and
    # + m apart, as gguf does (the dot products' fused multiply-adds are explicit intrinsics)
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    tag = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    try:
        with build_environment(CXX=pick_cxx()):
            build(name=f"{LIBRARY}_{tag}", sources=[str(_SOURCE)], is_python_module=False, extra_cflags=flags,
                  extra_ldflags=["-fopenmp"], verbose=False)
    except (RuntimeError, OSError, ImportError) as e:
        raise ToolchainError(f"the CPU packed-weight kernel ({_SOURCE.name}) did not build: {str(e)[-600:]}; install a "
                             "C++ compiler (g++), or export with the GGUF's weights as floats (--dequantize)") from e
