"""What a packed weight costs a wide product on CUDA today: the tile-ordered int4 weight unpacked to bf16
(`kernels.native.unpack`) and cuBLAS's GEMM, against cuBLAS on a bf16 weight, per Llama-3-8B projection, at the
prefill's 1k rows and a 64-session decode step's 64 (CUDA events over 20 eager calls each).

Usage (on a CUDA machine, from the repository root):
    python benchmarks/unpack_gemm_cuda.py --rows 1024,64 --out benchmarks/results/unpack_gemm_h200.json
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

from onecopy.kernels import native  # noqa: E402
from onecopy.layouts import MMA_LAYOUT_IDS  # noqa: E402
from onecopy.models.packed import tile_ordered  # noqa: E402
from onecopy.models.quantize import quantize_weight  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def us_per_call(f, reps: int = 20) -> float:
    f()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        f()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1024,64")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    native.load()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python " + " ".join(sys.argv), "rows": []}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda") / k ** 0.5
        wb = w.to(torch.bfloat16)
        p = tile_ordered(quantize_weight(w, "int4", 128))
        op = (p.qweight, p.scales, p.mins, MMA_LAYOUT_IDS[p.layout], p.group)
        for m in (int(v) for v in a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": name, "rows": m, "bf16_us": round(us_per_call(lambda: F.linear(x, wb)), 1),
                   "int4_unpack_gemm_us": round(us_per_call(lambda: F.linear(x, native.unpack(*op, torch.bfloat16))), 1)}
            res["rows"].append(row)
            print(row, flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
