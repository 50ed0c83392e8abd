"""FP8 projections (``--quantize fp8``) against bf16 on the Llama-3-8B shapes, eager, per row count (CUDA).

Usage (on a CUDA machine of compute capability 8.9+, from the repository root):
    python benchmarks/fp8_linear_cuda.py --out benchmarks/results/fp8_linear_h200.json

Per projection and M rows (1 to 8192): cuBLAS bf16 ``F.linear``; onecopy's `packed.fp8_linear` (x's rows
quantized to e4m3 with torch ops, then ``torch._scaled_mm``); and the FP8 GEMM alone. Each timed as the
median replay of a CUDA graph of one call (`attention_cuda.bench`). The row quantization here is several
eager kernels; in an exported bundle Inductor fuses it into one (benchmarks/decode_profile_cuda.py shows a
step's real share).
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
from onecopy.models.packed import fp8_linear, quantize_rows  # noqa: E402
from onecopy.models.quantize import quantize_weight  # noqa: E402

SHAPES = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w13": (28672, 4096), "w2": (4096, 14336), "lm_head": (128256, 4096)}
ROWS = (1, 16, 64, 256, 2048, 8192)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    results = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        p = quantize_weight(w, "fp8")
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q, s = quantize_rows(x)
            ref = F.linear(x, w).float()
            r = {"bf16_us": 1000 * bench(lambda: F.linear(x, w)), "fp8_us": 1000 * bench(lambda: fp8_linear(x, p)),
                 "scaled_mm_only_us": 1000 * bench(lambda: torch._scaled_mm(q, p.qweight.t(), scale_a=s,
                                                                            scale_b=p.scales.reshape(1, -1),
                                                                            out_dtype=torch.bfloat16)),
                 "rel_err": float((fp8_linear(x, p).float() - ref).norm() / ref.norm())}
            r = {key: round(v, 4 if key == "rel_err" else 1) for key, v in r.items()}
            r["speedup"] = round(r["bf16_us"] / r["fp8_us"], 3)
            results[f"{name}_m{m}"] = r
            print(name, m, r, flush=True)
    out = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "results": results}
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
