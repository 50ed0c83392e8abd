"""RMSNorm folded into the small-linear kernel vs a separate norm kernel, per 8B projection (CUDA).

Usage (on a CUDA machine, from the repository root):
    python benchmarks/norm_fold_cuda.py --out benchmarks/results/norm_fold_h200.json

Per projection of the 8B shape at 1 and 16 rows, each call reading a different copy of the weight
inside one CUDA graph (as `gemv_cuda.py`): ``plain_us`` the kernel alone, ``sep_norm_us`` a compiled
RMSNorm kernel then the kernel, ``folded_us`` the kernel with the norm folded in (given the row's sum
of squares, as the kernel producing the row hands it over). Where folded < separate, the decode folds
it (QKV, gate/up); the LM head's many programs each redo the scaling, so it keeps the norm kernel.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gemv_cuda import graph_ms  # noqa: E402
from onecopy import kernels  # noqa: E402
from onecopy.models.layers import rms_norm  # noqa: E402
from onecopy.models.projections import sum_of_squares  # noqa: E402

SHAPES = {"qkv": (6144, 4096, False), "gate_up": (28672, 4096, True), "lm_head": (128256, 4096, False),
          "o": (4096, 4096, False), "down": (4096, 14336, False)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    norm_c = torch.compile(rms_norm)
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "rows": []}
    for name, (n, k, glu) in SHAPES.items():
        copies = max(2, math.ceil(512e6 / (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5 for _ in range(copies)]
        g = 1 + 0.1 * torch.randn(k, device="cuda", dtype=dt)
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ss = sum_of_squares(x)
            tiles = kernels.small_linear_tiles(n // 2 if glu else n, glu)
            row = {"proj": name, "M": m}
            row["plain_us"] = 1e3 * graph_ms([functools.partial(kernels.launch_linear, x, w, None, glu, tiles) for w in ws])
            row["sep_norm_us"] = 1e3 * graph_ms([lambda w=w, x=x, g=g, glu=glu, tiles=tiles: kernels.launch_linear(norm_c(x, g, 1e-5), w, None, glu, tiles)  # noqa: E501
                                                 for w in ws])
            ref = kernels.launch_linear(norm_c(x, g, 1e-5), ws[0], None, glu, tiles)[0].float()
            row["folded_us"] = 1e3 * graph_ms([functools.partial(kernels.launch_linear, x, w, None, glu, tiles,
                                                                 (g, ss, 1e-5)) for w in ws])
            out = kernels.launch_linear(x, ws[0], None, glu, tiles, (g, ss, 1e-5))[0].float()
            row["folded_rel_err_vs_separate"] = float((out - ref).norm() / ref.norm())
            res["rows"].append({k2: round(v, 4) if isinstance(v, float) else v for k2, v in row.items()})
            print(json.dumps(res["rows"][-1]), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
