"""FP8 (f8r) weights through the native packed-projection op at a decode step's row counts, with the step's folds.

Usage (on an sm_89+ CUDA machine, from the repository root), once per build of the kernels:
    python benchmarks/fp8_rows_cuda.py --out /tmp/fp8_rows_8.json
    ONECOPY_NATIVE_DEFINES=ONECOPY_FP8_MAX_ROWS=16 python benchmarks/fp8_rows_cuda.py --out /tmp/fp8_rows_16.json

The op (`kernels.native.packed_linear`, layout f8r) runs the packed GEMV up to kFp8MaxRows rows and past that the
norm kernel, the rows quantized to e4m3, cuBLAS's FP8 GEMM and the fold kernel: two builds that differ only in
kFp8MaxRows time the two paths at the same rows. Per projection of the Llama-3-8B shape, the folds a decode step
gives it (the RMSNorm before qkv, gate/up and the LM head; SwiGLU after gate/up; the residual after o and down),
cold weights as benchmarks/gemv_cuda.py (copies enough for 512 MB, one CUDA graph replaying the calls), bf16
cuBLAS beside (no folds) for scale.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemv_cuda import cold_copies, graph_ms  # noqa: E402

from onecopy.kernels import native  # noqa: E402
from onecopy.layouts import F8R_NATIVE_ID  # noqa: E402
from onecopy.models.quantize import quantize_weight  # noqa: E402

# name: N, K, glu, norm before, residual after (a decode step's folds, `models.llama.fused_decode`)
SHAPES = {"qkv": (6144, 4096, False, True, False), "o": (4096, 4096, False, False, True),
          "gate_up": (28672, 4096, True, True, False), "down": (4096, 14336, False, False, True),
          "lm": (128256, 4096, False, True, False)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default="1,8,9,10,12,14,16")
    a = ap.parse_args()
    native.load()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "defines": native.DEFINES,
           "fp8_max_rows": native.FP8_MAX_ROWS, "command": "python " + " ".join(sys.argv), "rows": []}
    torch.manual_seed(0)
    for shape in a.shapes.split(","):
        n, k, glu, norm, residual = SHAPES[shape]
        n_out = n // 2 if glu else n
        w = torch.randn(n, k) / k ** 0.5
        f8 = quantize_weight(w, "fp8", k)
        f8 = f8.rebuild(tuple(t.cuda() for t in f8.tensors()))
        f8s = cold_copies(f8, f8.nbytes)
        bfs = cold_copies(w.to("cuda", torch.bfloat16), n * k * 2)
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            folds = {"glu": glu,
                     "norm": (nw, torch.rand(m, k // 16, device="cuda") * 16, 1e-5) if norm else None,
                     "residual": torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16) if residual else None}
            row = {"shape": shape, "N": n, "K": k, "rows": m,
                   "path": "gemv" if m <= native.fp8_gemv_rows(n) else "fp8 gemm", "us": {}}
            # each row against the op on that row alone (the GEMV at one row): equal bits where the GEMV takes all
            # rows (a row's sums never depend on the batch), e4m3 rounding of the rows where the FP8 GEMM does
            c = f8s[0]
            out = native.packed_linear(x, c.qweight, c.scales, None, F8R_NATIVE_ID, c.group, **folds)[0]
            alone = torch.cat([native.packed_linear(
                x[i:i + 1], c.qweight, c.scales, None, F8R_NATIVE_ID, c.group, glu=glu,
                norm=(nw, folds["norm"][1][i:i + 1], 1e-5) if norm else None,
                residual=folds["residual"][i:i + 1] if residual else None)[0] for i in range(m)])
            row["rows_equal_alone"] = bool(torch.equal(out, alone))
            row["max_abs_diff_alone"] = round(float((out.float() - alone.float()).abs().max()), 5)
            row["out_abs_max"] = round(float(alone.float().abs().max()), 4)
            row["us"]["fp8 op"] = round(1000 * graph_ms([functools.partial(
                native.packed_linear, x, c.qweight, c.scales, None, F8R_NATIVE_ID, c.group, **folds) for c in f8s]), 2)
            row["us"]["bf16 cuBLAS"] = round(1000 * graph_ms([functools.partial(F.linear, x, c) for c in bfs]), 2)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
        del f8s, bfs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
