"""Where a decode step's time goes: the kernels inside the captured graph, by kind (CUDA).

Usage (on a CUDA machine, from the repository root):
    python benchmarks/decode_profile_cuda.py --source llama3-8b-8l --context 1024 \
        --out benchmarks/results/decode_profile_llama3-8b-8l_h200.json

Replays the decode graph of ``--sessions`` rows (default 1), each at ``--context`` filled positions in
its own KV blocks, under torch.profiler and sums
the device time of every kernel per step: cuBLAS GEMMs, the Triton attention split and merge
kernels, Inductor's fused pointwise/reduction kernels (norms, RoPE, K/V writes, SiLU, residual
adds), and the rest; plus the wall time of a replay, whose excess over the kernels' sum is the gaps
between kernels. The layers of the 8-layer preset have the 8B shape, so per-layer figures carry over.
With ``--bundle`` naming an exported bundle it is profiled as it is (e.g. a 32-layer one with an 8-bit KV
cache): ``--sessions 256 --context 1024`` is a saturated step's breakdown.

With ``--prefill T`` it profiles a batched prefill call instead (`Runner.prefill_chunks`): ``--sessions`` chunks of
T prompt ids each, every one on its own row from position ``--context`` (0: fresh prompts), e.g. ``--sessions 64
--prefill 128 --context 0`` is one call of TensorRT-LLM's 128/128 point at a token budget of 8192.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onecopy  # noqa: E402
from onecopy.bench.decode import batched_step_ms, weight_layouts  # noqa: E402
from onecopy.runtime.plan import PrefillChunk  # noqa: E402

KINDS = [("attention_split", r"split_kernel"), ("attention_merge", r"merge_kernel"), ("small_linear", r"linear_kernel"),
         ("gemm", r"gemm|gemv|cutlass|nvjet|sm90_|cublas|splitK|reduce_kernel|f8f8bf16"), ("inductor_fused", r"^triton_")]


def kind(name: str) -> str:
    for k, pat in KINDS:
        if re.search(pat, name):
            return k
    return "other"


def timed_ms(step, steps: int, warmup: int) -> float:
    """Mean device time of ``step()`` over ``steps`` calls, after ``warmup`` (events around the loop)."""
    for _ in range(warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", default="llama3-8b-8l")
    ap.add_argument("--max-seq-len", type=int, default=16384)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--bundle", default="/tmp/onecopy-profile")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--sessions", type=int, default=1, help="rows decoded in one step, each at --context")
    ap.add_argument("--prefill", type=int, default=0, help="profile a batched prefill of this many ids a row instead")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    bundle = Path(a.bundle)
    if not (bundle / "manifest.json").is_file():
        onecopy.export(a.source, bundle, max_seq_len=a.max_seq_len, device="cuda", overwrite=True, progress=False)
    with onecopy.Engine.load(bundle, "cuda", max_sessions=a.sessions) as engine:
        sessions = [engine.open_session() for _ in range(a.sessions)]
        with engine.lock:  # each row's own blocks (paged KV), as a prefill would have taken them
            for s in sessions:
                engine.sessions._prepare(s, 0, a.context + max(a.prefill, 1))
                s.position = a.context
            engine.runner.apply(engine.scheduler.ops.take())
        rows, pos = [s.row for s in sessions], [s.position for s in sessions]
        tok = torch.ones(len(rows), dtype=torch.long, device="cuda")
        if a.prefill:
            gen = torch.Generator().manual_seed(0)  # real-looking ids: the embedding rows differ
            ids = torch.randint(100, 20000, (len(rows), a.prefill), generator=gen).tolist()
            chunks = [PrefillChunk(None, r, a.context, t) for r, t in zip(rows, ids)]

            def step() -> None:
                engine.runner.prefill_chunks(chunks)
            step_ms = timed_ms(step, a.steps, warmup=3)
        else:
            def step() -> None:
                engine.runner.decode(rows, pos, tok)
            step_ms = batched_step_ms(engine, sessions, steps=a.steps, warmup=10)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                step()
            torch.cuda.synchronize()
        n_layers = engine.manifest.config["n_layers"]
        kv_storage = engine.memory_report().kv_dtype
        layouts = weight_layouts(engine.manifest)
        max_seq_len = engine.max_seq_len  # the bundle's (a reused bundle may differ from --max-seq-len)
        for s in sessions:
            s.close()
    # One step's kernels in launch order (the last step's), so each projection's time can be read off.
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    per_step = len(events) // a.steps
    sequence = [[e.name[:60], round(e.time_range.elapsed_us(), 2)] for e in events[-per_step:]]
    kernels: dict[str, dict] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t <= 0:
            continue
        kernels[e.key] = {"us_per_step": t / a.steps, "calls_per_step": e.count / a.steps, "kind": kind(e.key)}
    by_kind: dict[str, dict] = {}
    for k in kernels.values():
        b = by_kind.setdefault(k["kind"], {"us_per_step": 0.0, "calls_per_step": 0.0})
        b["us_per_step"] += k["us_per_step"]
        b["calls_per_step"] += k["calls_per_step"]
    busy_us = sum(k["us_per_step"] for k in kernels.values())
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "source": a.source, "n_layers": n_layers, "context": a.context,
           "sessions": a.sessions, "prefill": a.prefill, "kv_storage": kv_storage, "weight_layouts": layouts,
           "tok_s": round(1000 * a.sessions * max(a.prefill, 1) / step_ms, 1),
           "max_seq_len": max_seq_len, "step_ms_graph_replay": round(step_ms, 4),  # a prefill: one eager call
           "call": "prefill_chunks" if a.prefill else "decode graph replay",
           "kernel_busy_ms": round(busy_us / 1000, 4), "gaps_ms": round(step_ms - busy_us / 1000, 4),
           "by_kind": {k: {"us_per_step": round(v["us_per_step"], 1), "calls_per_step": round(v["calls_per_step"], 1),
                           "us_per_layer": round(v["us_per_step"] / n_layers, 2)} for k, v in by_kind.items()},
           "kernels": dict(sorted(((n, {**v, "us_per_step": round(v["us_per_step"], 2)}) for n, v in kernels.items()),
                                  key=lambda kv: -kv[1]["us_per_step"])),
           "last_step_sequence": sequence}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("kernels", "last_step_sequence")}, indent=1))
    for n, v in list(res["kernels"].items())[:25]:
        print(f"{v['us_per_step']:9.1f} us {v['calls_per_step']:6.1f}x {v['kind']:<16} {n[:110]}")


if __name__ == "__main__":
    main()
