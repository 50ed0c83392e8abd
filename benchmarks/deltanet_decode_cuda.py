"""Qwen3.5's DeltaNet decode step on CUDA: the one-kernel step (`kernels.deltanet`) against the eager step's ops.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/deltanet_decode_cuda.py --out benchmarks/results/deltanet_decode_h100.json

One DeltaNet layer of the Qwen3.5-35B-A3B shape (width 2048; 16 key / 32 value heads of 128; conv kernel 4), bf16,
random weights, N sessions in a pool of 2 N rows at positions > 0: the step from the input projection's output to
the output projection's input (the kernel, or the eager ops that it replaces: conv, SiLU, norms, gates, delta rule,
gated norm, state gathers and writes), each captured in a CUDA graph and replayed; microseconds a step, and the
bytes of state it must read and write (conv window and fp32 recurrent state, once each) over that time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemv_cuda import graph_ms  # noqa: E402

from onecopy import kernels  # noqa: E402
from onecopy.models import qwen3_5_deltanet  # noqa: E402
from onecopy.models.attention import Step  # noqa: E402
from onecopy.models.presets import PRESETS  # noqa: E402


def step_us(m: qwen3_5_deltanet.GatedDeltaNet, n: int, fused: bool) -> float:
    """Microseconds of one decode step of ``n`` sessions between the projections (replayed in a CUDA graph)."""
    rows = torch.arange(0, 2 * n, 2, device="cuda")
    step = Step(rows, torch.full((n,), 100, device="cuda"), True)
    conv = torch.randn(2 * n, m.conv_dim, m.kernel, device="cuda", dtype=torch.bfloat16)
    rec = torch.randn(2 * n, m.nv, m.dk, m.dv, device="cuda") * 0.1
    x = torch.randn(n, 1, m.in_proj.in_features, device="cuda", dtype=torch.bfloat16)
    proj = m.in_proj(x)
    out_proj, in_proj = m.out_proj, m.in_proj
    m.out_proj = m.in_proj = torch.nn.Identity()  # the projections are not what is timed
    try:
        with mock.patch.object(kernels, "available", return_value=fused), torch.no_grad():
            return 1000 * graph_ms([lambda: m(proj, step, conv, rec, 1)], reps=50)
    finally:
        m.out_proj, m.in_proj = out_proj, in_proj


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sessions", default="1,16,64")
    a = ap.parse_args()
    cfg = dataclasses.replace(PRESETS["qwen3.5-35b-a3b"].config)
    torch.manual_seed(0)
    m = qwen3_5_deltanet.GatedDeltaNet(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() < 2 else p.shape[-1] ** -0.5))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
           "rows": []}
    for n in map(int, a.sessions.split(",")):
        state_bytes = n * (m.conv_dim * m.kernel * 2 + m.nv * m.dk * m.dv * 4) * 2  # read and written once
        row = {"sessions": n, "state_MB": round(state_bytes / 1e6, 2)}
        for name, fused in (("kernel", True), ("eager", False)):
            us = step_us(m, n, fused)
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_GBps"] = round(state_bytes / us / 1e3, 1)
        row["speedup"] = round(row["eager_us"] / row["kernel_us"], 2)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
