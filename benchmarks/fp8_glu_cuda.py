"""The FP8 down projection's input: SwiGLU rows made and quantized in one kernel, against the unfused ops (CUDA).

Usage (on a CUDA machine of compute capability 8.9+, from the repository root):
    python benchmarks/fp8_glu_cuda.py --out benchmarks/results/fp8_glu_h200.json

Llama-3-8B's w2 (4096 x 14336, e4m3, a scale per output feature) at the row counts of a decode step (1, 64, 1024) and
of a batched prefill call (8192 = TensorRT-LLM's 128/128 point at a token budget of 8192): `native.fp8_glu_linear`
(one kernel makes silu(gate) * up and quantizes each row, then cuBLAS's row-wise FP8 GEMM; up to 8 rows one kernel
makes them for the FP8 GEMV) against what the compiled model ran before: Inductor's SwiGLU kernel (torch.compile of
silu(gate) * up), then `native.fp8_linear` (which quantizes the rows again in its own kernel). Each the median of
CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention_cuda import bench  # noqa: E402  (this folder: the benchmarks' one graph-replay timer)
from onecopy.kernels import native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rows", default="1,64,1024,8192")
    args = ap.parse_args()
    torch.manual_seed(0)
    n, k = 4096, 14336
    w = (torch.randn(n, k, device="cuda") * 4).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.full((n,), 1 / (4 * k ** 0.5), device="cuda")
    swiglu = torch.compile(lambda h: F.silu(h[:, :k]) * h[:, k:])
    runs = []
    for m in (int(r) for r in args.rows.split(",")):
        h = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16) * 3
        swiglu(h)  # compiled before the timing
        fused = 1e3 * bench(lambda: native.fp8_glu_linear(h, w, ws))
        unfused = 1e3 * bench(lambda: native.fp8_linear(swiglu(h), w, ws))
        runs.append({"rows": m, "fused_us": round(fused, 1), "unfused_us": round(unfused, 1),
                     "saved_us": round(unfused - fused, 1), "speedup": round(unfused / fused, 3)})
        print(runs[-1])
    out = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": {"n": n, "k": k}, "runs": runs}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
