"""Skinny linear layers on CUDA: onecopy's small-linear Triton kernel vs cuBLAS, per Llama-3-8B projection.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/gemv_cuda.py --out benchmarks/results/gemv_h200.json

For each projection of the 8B shape as a decode step calls it (fused QKV 6144x4096; output
4096x4096 + residual add; fused gate/up 28672x4096 + SwiGLU; down 4096x14336 + residual add; LM head
128256x4096) and each row count M (a step of M sessions), every call reads a different copy of the
weight (copies enough for 512 MB: cold L2, as inside a decode step where each layer's weights are
read once) and the calls of one case are replayed as one CUDA graph, so the per-call time includes
the gaps a decode step's graph has between kernels.
- ``cublas``: ``F.linear`` then the SwiGLU or residual add as torch ops (what the step ran before);
- ``triton (BLOCK_N, BLOCK_K, warps, stages)``: `kernels.launch_linear`, the elementwise work folded in.
The tiles that win per projection are what `kernels.small_linear_tiles` returns. GB/s count the
weight bytes only; ``copy_GBps`` is a device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from onecopy.bench.decode import copy_bandwidth  # noqa: E402
from onecopy import kernels  # noqa: E402

# name: (N, K, SwiGLU after, residual add after)
SHAPES = {
    "qkv": (6144, 4096, False, False),
    "o": (4096, 4096, False, True),
    "gate_up": (28672, 4096, True, False),
    "down": (4096, 14336, False, True),
    "lm_head": (128256, 4096, False, False),
}
TILES = [t for t in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (2, 3, 4))]
ROWS = (1, 4, 16)


def graph_ms(calls, reps: int = 10) -> float:
    """Median ms of one replay of a CUDA graph holding ``calls`` (a list of thunks), per call."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    del g
    return statistics.median(times) / len(calls)


def cold_copies(t, nbytes: int) -> list:
    """Copies of a weight (a tensor, or a packed weight: its ``tensors()`` cloned into ``rebuild``) enough for
    512 MB, at least two: replayed in turn, each call reads its weight from HBM, not from L2."""
    count = max(2, math.ceil(512e6 / nbytes))
    if isinstance(t, torch.Tensor):
        return [t.clone() for _ in range(count)]
    return [t.rebuild(tuple(x_.clone() for x_ in t.tensors())) for _ in range(count)]


def torch_chain(x, w, res, glu: bool):
    """cuBLAS and the elementwise work as torch ops."""
    y = F.linear(x, w)
    if glu:
        g, u = y.chunk(2, dim=-1)
        y = F.silu(g) * u
    return y if res is None else res + y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M (more than 16: row blocks)")
    ap.add_argument("--block-m", type=int, default=kernels.SMALL_LINEAR_ROWS,
                    help="rows per program: 16, or 64 (the batch-invariant decode past 16 rows)")
    ap.add_argument("--chosen-only", action="store_true", help="time only the tiles small_linear_tiles picks")
    a = ap.parse_args()
    rows = [int(m) for m in a.rows.split(",")]
    torch.manual_seed(0)
    dt = torch.bfloat16
    copy_gbps = copy_bandwidth() / 1e9
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "block_m": a.block_m,
           "torch": torch.__version__, "copy_GBps": round(copy_gbps, 1), "rows": [], "best_tiles": {}}
    print("copy GB/s", round(copy_gbps, 1), flush=True)
    for name in a.shapes.split(","):
        n, k, glu, residual = SHAPES[name]
        nbytes = n * k * 2
        copies = max(2, math.ceil(512e6 / nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5 for _ in range(copies)]
        wins: dict[tuple, float] = {}
        wide = a.block_m > kernels.SMALL_LINEAR_ROWS  # the batch-invariant decode's tiles
        chosen = kernels.small_linear_tiles(n // 2 if glu else n, glu, invariant=wide)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            r = torch.randn(m, n // 2 if glu else n, device="cuda", dtype=dt) if residual else None
            ref = torch_chain(x.double(), ws[0].double(), None if r is None else r.double(), glu)
            row = {"proj": name, "N": n, "K": k, "glu": glu, "residual": residual, "M": m,
                   "weight_MB": round(nbytes / 1e6, 1), "copies": copies}
            ms = graph_ms([functools.partial(torch_chain, x, w, r, glu) for w in ws])
            row["cublas_ms"], row["cublas_GBps"] = round(ms, 5), round(nbytes / ms / 1e6, 1)
            for tiles in [chosen] if a.chosen_only else TILES:
                label = f"triton {tiles}"
                try:
                    out = kernels.launch_linear(x, ws[0], r, glu, tiles, block_m=a.block_m)[0]
                    err = float((out.double() - ref).norm() / ref.norm())
                    ms = graph_ms([functools.partial(kernels.launch_linear, x, w, r, glu, tiles, block_m=a.block_m) for w in ws])
                except Exception as e:  # noqa: BLE001  a tile that does not fit: record and go on
                    row[label] = repr(e)[:100]
                    continue
                if err > 1e-2:
                    row[label] = f"rel err {err:.3g}"
                    continue
                row[f"{label} ms"] = round(ms, 5)
                wins[tiles] = wins.get(tiles, 0.0) + ms * (4 if m == 1 else 1)  # batch 1 weighs most
            best = min((v, key) for key, v in row.items() if key.startswith("triton") and key.endswith(" ms"))
            row["best"], row["best_ms"] = best[1][7:-3], best[0]
            row["best_GBps"], row["best_vs_cublas"] = round(nbytes / best[0] / 1e6, 1), round(row["cublas_ms"] / best[0], 3)
            row["chosen"], row["chosen_ms"] = str(chosen), row.get(f"triton {chosen} ms")
            if row["chosen_ms"]:
                row["chosen_vs_cublas"] = round(row["cublas_ms"] / row["chosen_ms"], 3)
            res["rows"].append(row)
            print(json.dumps({key: v for key, v in row.items() if not key.startswith("triton")}), flush=True)
        res["best_tiles"][name] = min(wins, key=wins.get)
        print(name, "best tiles", res["best_tiles"][name], flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
        del ws


if __name__ == "__main__":
    main()
