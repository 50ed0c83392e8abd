"""Packed (int8 / int4) skinny linears on CUDA: the packed small-linear kernel vs the bf16 one, per 8B projection.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/packed_gemv_cuda.py --out benchmarks/results/packed_gemv_h100.json

As benchmarks/gemv_cuda.py (cold weights: copies enough for 512 MB, calls replayed as one CUDA graph),
for the bf16 weight with `kernels.small_linear_tiles` and for each packed layout over a few tiles;
GB/s count the bytes each kernel must read (packed values + float32 scales and mins). The tiles that
win per projection and layout width (4-bit / 8-bit), batch 1 weighted most, are what
`kernels.packed_linear_tiles` returns.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemv_cuda import SHAPES, graph_ms  # noqa: E402

from onecopy import kernels  # noqa: E402
from onecopy.bench.decode import copy_bandwidth  # noqa: E402
from onecopy.models.packed import LAYOUT_IDS  # noqa: E402
from onecopy.models.quantize import quantize_weight  # noqa: E402

TILES = [(32, 128, 4, 3), (32, 256, 4, 3), (32, 512, 4, 4), (64, 256, 4, 4), (64, 256, 8, 4), (64, 512, 8, 3),
         (32, 1024, 8, 3), (128, 256, 8, 3)]
FORMATS = {"int8 g128": ("int8", 128), "int4 g128": ("int4", 128), "int4 g32": ("int4", 32)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--chosen-only", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy_GBps": round(copy_bandwidth() / 1e9, 1), "rows": [], "best_tiles": {}}
    for name in a.shapes.split(","):
        n, k, glu, residual = SHAPES[name]
        n_out = n // 2 if glu else n
        w0 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        dense_copies = max(2, math.ceil(512e6 / (2 * n * k)))
        dense = [w0.clone() for _ in range(dense_copies)]
        for fmt in a.formats.split(","):
            mode, group = FORMATS[fmt]
            p = quantize_weight(w0, mode, group)
            copies = max(2, math.ceil(512e6 / p.nbytes))
            ps = [p.rebuild(tuple(t.clone() for t in p.tensors())) for _ in range(copies)]
            layout = LAYOUT_IDS[p.layout]
            chosen = kernels.packed_linear_tiles(n_out, glu, layout)
            wins: dict[tuple, float] = {}
            for m in [int(r) for r in a.rows.split(",")]:
                block_m = kernels.SMALL_LINEAR_ROWS if m <= kernels.SMALL_LINEAR_ROWS else kernels.INVARIANT_ROWS
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                r = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16) if residual else None
                bf = kernels.small_linear_tiles(n_out, glu, block_m > kernels.SMALL_LINEAR_ROWS)
                row = {"proj": name, "format": fmt, "M": m, "packed_MB": round(p.nbytes / 1e6, 1),
                       "bf16_MB": round(2 * n * k / 1e6, 1), "chosen": str(chosen)}
                bf_ms = graph_ms([functools.partial(kernels.launch_linear, x, w, r, glu, bf, None, block_m) for w in dense])
                row["bf16_ms"] = round(bf_ms, 5)
                for tiles in [chosen] if a.chosen_only else TILES:
                    try:
                        ms = graph_ms([functools.partial(kernels.launch_linear, x, q.qweight, r, glu, tiles, None, block_m,
                                                         (q.scales, q.mins, layout, q.group)) for q in ps])
                    except Exception as e:  # noqa: BLE001  a tile that does not fit
                        row[f"{tiles}"] = repr(e)[:80]
                        continue
                    row[f"{tiles} ms"] = round(ms, 5)
                    wins[tiles] = wins.get(tiles, 0.0) + ms * (4 if m == 1 else 1)
                best = min((v, key) for key, v in row.items() if key.endswith(" ms") and key.startswith("("))
                row.update(best=best[1][:-3], best_ms=best[0], best_GBps=round(p.nbytes / best[0] / 1e6, 1),
                           best_vs_bf16=round(bf_ms / best[0], 3), chosen_ms=row.get(f"{chosen} ms"))
                if row["chosen_ms"]:
                    row["chosen_vs_bf16"] = round(bf_ms / row["chosen_ms"], 3)
                    row["chosen_GBps"] = round(p.nbytes / row["chosen_ms"] / 1e6, 1)
                res["rows"].append(row)
                print(json.dumps({key: v for key, v in row.items() if not key.startswith("(")}), flush=True)
            res["best_tiles"][f"{name} {fmt}"] = str(min(wins, key=wins.get))
            print(name, fmt, "best tiles", res["best_tiles"][f"{name} {fmt}"], flush=True)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(res, indent=1))
            del ps


if __name__ == "__main__":
    main()
