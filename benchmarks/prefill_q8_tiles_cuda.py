"""Tiles for the batched prefill attention over an 8-bit paged cache (CUDA): the saturated prefill calls' shapes.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/prefill_q8_tiles_cuda.py --out benchmarks/results/prefill_q8_tiles_h100.json

Why: in a 64 x 128-id prefill call of the 8B shape (TensorRT-LLM's 128/128 point at a token budget of 8192) the
attention took 7.6 ms of 129 (H200, benchmarks/results/prefill_profile_llama3-8b_fp8w_int8_64x128_h200.json), ~240 us
a layer for ~20 MB of K/V and queries: far from the copy bandwidth, so launch shape and tiles are the suspects.
For each point (chunks x ids, all fresh prompts on their own rows, int8 K/V in shuffled 16-position pages; one layer of
Llama-3-8B: 32 query heads, 8 KV heads of 128) every (BLOCK_M, BLOCK_N, warps, stages) below is timed as the median
of CUDA-graph replays (`attention_cuda.bench`); the table ends with `kernels.PREFILL_TILES`' choice and the best.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention_cuda import bench  # noqa: E402  (this folder)

from onecopy.kernels import tiles  # noqa: E402
from onecopy.kernels.prefill import launch_prefill_paged  # noqa: E402
from onecopy.models import kv_quant  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
SWEEP = [c for c in itertools.product((32, 64, 128), (32, 64), (4, 8), (2, 3)) if not (c[0] == 128 and c[2] == 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="64x128,8x1024", help="CHUNKSxIDS,...")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "current": list(tiles.PREFILL_TILES[D]), "points": []}
    for point in a.points.split(","):
        b, t = (int(v) for v in point.split("x"))
        pool = 2 * t
        nb = (b + 1) * pool // BS
        table = torch.randperm(nb, device="cuda").view(b + 1, pool // BS)
        kq, ks = kv_quant.quantize(torch.randn(nb, HKV, BS, D, device="cuda", dtype=torch.bfloat16), torch.int8)
        vq, vs = kv_quant.quantize(torch.randn(nb, HKV, BS, D, device="cuda", dtype=torch.bfloat16), torch.int8)
        q = torch.randn(b, t, HQ, D, device="cuda", dtype=torch.bfloat16)
        rows = torch.arange(b, device="cuda")
        pos = torch.arange(t, device="cuda")[None].expand(b, t).contiguous()
        timed = {}
        for cfg in dict.fromkeys([tuple(tiles.PREFILL_TILES[D])] + SWEEP):
            try:
                us = 1000 * bench(lambda: launch_prefill_paged(q, kq, vq, table, rows, pos, cfg, (ks, vs)), 30)
            except Exception as e:  # a tile that does not fit (shared memory, registers)
                print(f"{point} {cfg}: {type(e).__name__}", flush=True)
                continue
            timed[cfg] = us
            print(f"{point} {cfg}: {us:.1f} us", flush=True)
        best = min(timed, key=timed.get)
        cur = tuple(tiles.PREFILL_TILES[D])
        res["points"].append({"chunks": b, "ids": t, "us": {str(list(k)): round(v, 1) for k, v in timed.items()},
                              "current_us": round(timed[cur], 1), "best": list(best), "best_us": round(timed[best], 1)})
        print(f"== {point}: current {cur} {timed[cur]:.1f} us, best {best} {timed[best]:.1f} us", flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
