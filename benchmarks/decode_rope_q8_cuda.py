"""The decode step's attention op over an 8-bit cache, native (CUDA C++) vs Triton, by batch.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/decode_rope_q8_cuda.py --out benchmarks/results/decode_rope_q8_h100.json

What a decode step runs per layer: RoPE on q and the new k, the new k/v quantized and cached, q against the
row's positions (`kernels.paged_decode_attention_rope_q8`, ``native`` True or False), one layer of the
Llama-3-8B shape (32 heads, 8 KV heads, head_dim 128), every session at the same position, pages of 16
positions in shuffled order. Each point is the median of CUDA-graph replays (`attention_cuda.bench`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention_cuda import bench  # noqa: E402  (this folder)

from onecopy import kernels  # noqa: E402
from onecopy.models import kv_quant  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
POINTS = ((1, 1024, 2048), (1, 4096, 8192), (16, 1024, 2048), (64, 1024, 2048), (256, 1024, 2048))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--points", default=",".join(f"{b}x{c}x{p}" for b, c, p in POINTS),
                    help="BATCHxCONTEXTxPOOL,...: e.g. 1024x200x256 is a saturated 128/128 step")
    ap.add_argument("--formats", default="int8,fp8")
    ap.add_argument("--native-only", action="store_true", help="time the native kernel alone (e.g. under ncu)")
    a = ap.parse_args()
    points = [tuple(int(v) for v in pt.split("x")) for pt in a.points.split(",")]
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "shape": {"heads": HQ, "kv_heads": HKV, "head_dim": D, "page": BS}, "runs": []}
    for fmt in a.formats.split(","):
        for b, ctx, pool in points:
            nb = (b + 1) * pool // BS
            qkv = torch.randn(b, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
            angles = torch.rand(b, D // 2, device="cuda") * 6
            cos, sin = (f(torch.cat((angles, angles), -1)).to(torch.bfloat16) for f in (torch.cos, torch.sin))
            table = torch.randperm(nb, device="cuda").view(b + 1, pool // BS)
            dtype = kv_quant.KV_DTYPES[fmt]
            kq, ks = kv_quant.quantize(torch.randn(nb, HKV, BS, D, device="cuda", dtype=torch.bfloat16), dtype)
            vq, vs = kv_quant.quantize(torch.randn(nb, HKV, BS, D, device="cuda", dtype=torch.bfloat16), dtype)
            rows, pos = torch.arange(b, device="cuda"), torch.full((b,), ctx - 1, device="cuda")
            us = {nat: 1000 * bench(lambda: kernels.paged_decode_attention_rope_q8(
                qkv, cos, sin, kq, vq, ks, vs, table, rows, pos, native=nat), 200)
                  for nat in ((True,) if a.native_only else (False, True))}
            us.setdefault(False, float("nan"))
            kv_bytes = b * HKV * (ctx - 1) * (2 * D + 8)  # K and V bytes and their scales, each read once
            r = {"kv": fmt, "batch": b, "context": ctx, "pool": pool, "triton_us": round(us[False], 1),
                 "native_us": round(us[True], 1), "speedup_native": round(us[False] / us[True], 2),
                 "native_tb_s": round(kv_bytes / us[True] / 1e6, 3)}
            res["runs"].append(r)
            print(f"{fmt} B={b} ctx={ctx} pool={pool}: triton {r['triton_us']} us, native {r['native_us']} us, "
                  f"x{r['speedup_native']}, native {r['native_tb_s']} TB/s of KV", flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
