"""The native library's CUDA sources build for every GPU its ops admit, not only the one at hand: `native.load()`
compiles for the device's own architecture, so an instruction newer than an A100's (an e4m3 conversion, a
warpgroup MMA) left unguarded breaks the library there alone. Needs nvcc; runs with the GPU tests (on the GPU
machine's cores a minute; on CI's two, without a GPU, it would add three to the suite)."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

NATIVE = Path(__file__).resolve().parents[2] / "onecopy" / "kernels" / "native"
# linear_serves admits sm_80+; fp8 needs sm_89; wgmma needs sm_90a (what native.load builds on an H100 / H200)
ARCHES = ("80", "89", "90a")


@pytest.mark.skipif(shutil.which("nvcc") is None or not torch.cuda.is_available(),
                    reason="needs nvcc; runs with the GPU tests")
@pytest.mark.timeout(600)
def test_every_cuda_source_builds_for_every_admitted_architecture(tmp_path):
    sources = sorted(p.name for p in NATIVE.glob("*.cu"))
    assert {"decode_q8.cu", "packed_linear.cu", "packed_gemm.cu", "packed_wgmma.cu"} <= set(sources)

    def build(job: tuple[str, str]) -> tuple[str, str, int, str]:
        src, arch = job
        # -Xptxas -O0: the architecture checks are ptxas's; its optimizer is not what this tests
        cmd = ["nvcc", "-std=c++17", "-Xptxas", "-O0", f"-gencode=arch=compute_{arch},code=sm_{arch}",
               f"-I{NATIVE}", "-c", str(NATIVE / src), "-o", str(tmp_path / f"{src}.{arch}.o")]
        done = subprocess.run(cmd, capture_output=True, text=True)
        return src, arch, done.returncode, done.stderr[-800:]

    with ThreadPoolExecutor(max_workers=6) as pool:
        failed = [r for r in pool.map(build, [(s, a) for s in sources for a in ARCHES]) if r[2] != 0]
    assert not failed, failed
