"""Which FP8 GEMM the prefill and a saturated decode should run: row-wise vs tensor-wise scales (CUDA).

Usage (on a CUDA machine of compute capability 8.9+, from the repository root):
    python benchmarks/fp8_gemm_scaling_cuda.py | tee benchmarks/results/fp8_gemm_scaling_h200.txt

Per Llama-3-8B projection at M = 1024 (a saturated decode step) and 8192 (a batched prefill call of TensorRT-LLM's
128/128 point at a token budget of 8192): cuBLAS bf16; ``torch._scaled_mm`` with a scale per row and per output
feature (onecopy's ``f8r``: dynamic per-token activation scales); the same GEMM with one scale per tensor (what
static, calibrated activation scales would allow); and onecopy's whole op (`kernels.native.fp8_linear`: the rows
quantized in one kernel, then the row-wise GEMM). Each the median of CUDA-graph replays (`attention_cuda.bench`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention_cuda import bench  # noqa: E402  (this folder: the benchmarks' one graph-replay timer)
from onecopy.kernels import native  # noqa: E402

SHAPES = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336)}


def main() -> None:
    torch.manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    total: dict[tuple[int, str], float] = {}
    for m in (1024, 8192):
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
            w8 = (wb * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            sw = torch.full((n,), 1 / 64, device="cuda")
            x8 = x.clamp(-448, 448).to(torch.float8_e4m3fn)
            sx, one = torch.ones(m, 1, device="cuda"), torch.ones((), device="cuda")
            runs = {
                "bf16": lambda: F.linear(x, wb),
                "rowwise": lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw.reshape(1, -1),
                                                    out_dtype=torch.bfloat16),
                "tensorwise": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                "native_op": lambda: native.fp8_linear(x, w8, sw),
            }
            us = {kind: 1000 * bench(fn, 50) for kind, fn in runs.items()}
            flops = 2 * m * n * k
            print(f"M={m} {name:5s} " + "  ".join(f"{kind} {v:8.1f}us {flops / v / 1e6:6.0f}TF" for kind, v in us.items()),
                  flush=True)
            for kind, v in us.items():
                total[(m, kind)] = total.get((m, kind), 0.0) + v
    for (m, kind), v in sorted(total.items()):
        print(f"M={m} layer total {kind}: {v:.1f} us")


if __name__ == "__main__":
    main()
