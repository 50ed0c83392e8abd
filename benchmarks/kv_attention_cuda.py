"""Decode attention at saturation, by KV storage: the paged split-KV kernel over bf16, int8 and fp8 caches.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/kv_attention_cuda.py --out benchmarks/results/kv_attention_h200.json

One layer of the Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128), pages of 16 positions
(the default export) in shuffled order, a block table of a 4k pool (what a max_seq_len-4096 export
passes), B sessions each of a context drawn in [0.9 L, L]. Each point is the median of CUDA-graph
replays of the kernel pair (split + merge) the exported decode runs, `kernels.paged_decode_attention`
or its ``_q8`` op. Bytes counted: what a step must read, the filled K and V of every session (and
their float32 scales for 8-bit), plus q and the output; the share is against the device-to-device copy
bandwidth measured in the same run. The merge's partial results are not counted (the kernel's own cost).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention_cuda import bench, copy_bandwidth  # noqa: E402  (this folder: the same timing as its table)

from onecopy import kernels  # noqa: E402
from onecopy.models import kv_quant  # noqa: E402

HQ, HKV, D, BS, POOL = 32, 8, 128, 16, 4096


def case(batch: int, context: int, fmt: str) -> dict:
    width = POOL // BS
    need = -(-context // BS)  # pages a session of the longest context fills
    blocks = batch * need + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(int(context * 0.9), context + 1, (batch,), device="cuda", generator=g)
    table = torch.full((batch, width), blocks - 1, dtype=torch.long, device="cuda")
    table[:, :need] = torch.randperm(batch * need, device="cuda", generator=g).view(batch, need)
    rows = torch.arange(batch, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    kf = torch.randn(blocks, HKV, BS, D, device="cuda", dtype=torch.bfloat16)
    vf = torch.randn_like(kf)
    filled = int(lengths.sum())
    if fmt == "bf16":
        k, v = kf, vf
        fn = lambda: kernels.paged_decode_attention(q, k, v, table, rows, lengths)  # noqa: E731
        per_position = 2 * HKV * D * 2
    else:
        dtype = kv_quant.KV_DTYPES[fmt]
        (k, ks), (v, vs) = kv_quant.quantize(kf, dtype), kv_quant.quantize(vf, dtype)
        fn = lambda: kernels.paged_decode_attention_q8(q, k, v, ks, vs, table, rows, lengths)  # noqa: E731
        per_position = 2 * HKV * (D + 4)
    del kf, vf
    ms = bench(fn)
    needed = filled * per_position + 2 * q.numel() * q.element_size()
    return {"batch": batch, "context": context, "kv": fmt, "ms": round(ms, 4), "needed_bytes": needed,
            "filled_positions": filled}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,64,128,256")
    ap.add_argument("--contexts", default="1024,2048,4096")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    bw = copy_bandwidth()
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__,
           "shape": {"heads": HQ, "kv_heads": HKV, "head_dim": D, "page": BS, "pool": POOL},
           "copy_bandwidth_TBps": round(bw / 1e12, 3), "runs": []}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'B':>4} {'ctx':>5} {'kv':<5} {'ms':>8} {'share':>6} {'vs bf16':>8}")
    for batch in map(int, a.batches.split(",")):
        for context in map(int, a.contexts.split(",")):
            base = None
            for fmt in ("bf16", "int8", "fp8"):
                r = case(batch, context, fmt)
                r["share_of_copy_bw"] = round(r["needed_bytes"] / (r["ms"] / 1000) / bw, 3)
                base = base or r["ms"]
                r["speedup_vs_bf16"] = round(base / r["ms"], 3)
                res["runs"].append(r)
                print(f"{batch:>4} {context:>5} {fmt:<5} {r['ms']:>8.4f} {r['share_of_copy_bw']:>6.3f} "
                      f"{r['speedup_vs_bf16']:>8.2f}", flush=True)
                torch.cuda.empty_cache()
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
