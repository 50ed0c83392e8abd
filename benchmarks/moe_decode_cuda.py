"""Qwen3.5 MoE's routed experts in a decode step on CUDA: the grouped kernels (`kernels.moe`) against the step as
Inductor compiles it (`Experts.routed`: gathers feeding fused products, what an exported bundle runs).

Usage (on a CUDA machine, from the repository root):
    python benchmarks/moe_decode_cuda.py --out benchmarks/results/moe_decode_h100.json
    python benchmarks/moe_decode_cuda.py --hidden-tiles 16,32 --out ...   # gate/up programs of 16 / 32 hidden units too

One MoE layer's routed experts of the Qwen3.5-35B-A3B shape (256 experts of width 512 over 2048, 8 a token), bf16,
random weights and routing, N rows; each variant captured in a CUDA graph and replayed (cold weights: copies of the
expert stacks over 2 GB, one a call); microseconds a step, and the bytes of the distinct experts the rows chose
over that time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemv_cuda import graph_ms  # noqa: E402

from onecopy.kernels.moe import launch_moe_routed  # noqa: E402
from onecopy.models.qwen3_5 import Experts  # noqa: E402

E, D, INTER, K = 256, 2048, 512, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sessions", default="1,4,16,64")
    ap.add_argument("--hidden-tiles", default="", help="comma-separated gate/up hidden tiles to time besides the "
                                                          "default (launch_moe_routed's hidden_tile: 16, 32)")
    a = ap.parse_args()
    torch.manual_seed(0)
    layers = []
    for _ in range(3):  # 3 x 1.6 GB: each call reads its experts from HBM, not L2
        ex = Experts(E, D, INTER).to("cuda", torch.bfloat16)
        with torch.no_grad():
            ex.gate_up_proj.normal_(0, D ** -0.5), ex.down_proj.normal_(0, INTER ** -0.5)
        layers.append(ex)
    compiled = [torch.compile(ex.routed, dynamic=False) for ex in layers]
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
           "rows": []}
    expert_bytes = 3 * D * INTER * 2
    with torch.no_grad():
        for n in map(int, a.sessions.split(",")):
            x = torch.randn(n, D, device="cuda", dtype=torch.bfloat16)
            idx = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(n)])
            top = torch.softmax(torch.randn(n, K, device="cuda"), -1).to(torch.bfloat16)
            distinct = int(idx.unique().numel())
            row = {"sessions": n, "distinct_experts": distinct, "expert_MB": round(distinct * expert_bytes / 1e6, 1)}
            kernel = 1000 * graph_ms([lambda ex=ex: launch_moe_routed(x, idx, top, ex.gate_up_proj, ex.down_proj)
                                      for ex in layers])
            inductor = 1000 * graph_ms([lambda f=f: f(x, idx, top) for f in compiled])
            tiles = {f"kernel_bi{bi}": 1000 * graph_ms([lambda ex=ex, bi=bi: launch_moe_routed(
                x, idx, top, ex.gate_up_proj, ex.down_proj, hidden_tile=bi) for ex in layers])
                for bi in map(int, filter(None, a.hidden_tiles.split(",")))}
            for name, us in (("kernel", kernel), ("inductor", inductor), *tiles.items()):
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_GBps"] = round(distinct * expert_bytes / us / 1e3, 1)
            row["speedup"] = round(inductor / kernel, 2)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
