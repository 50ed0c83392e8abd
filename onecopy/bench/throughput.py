"""`onecopy bench throughput`: offline throughput as `trtllm-bench` and `vllm bench throughput` measure it.

For each input/output point, N requests of random token ids (fixed input length, exactly the output length:
no stop ids; N by default what TensorRT-LLM ran at the point, 32 on the CPU) are submitted to the engine at once; the
engine's rows take them as they free. Reported per point: output tok/s (all generated tokens over the wall
time from the first submit to the last token, prefill included: TensorRT-LLM's "output throughput per GPU"),
requests/s, time to first token and inter-token latency p50/p99, the mean decode batch, the rows and KV
blocks the engine has, and the device time of the prefill calls, decode steps and sampling
(`runtime.phase_times`): what the rest of the wall time is the host's.
``prefill="both"`` measures each point twice on one engine, first with one prefill call per prompt chunk
(the baseline) and then with equal-length chunks batched into one call (the default). TensorRT-LLM's published
Llama-3.1-8B FP8 figures (v1.0 performance overview: output tok/s per GPU, all requests at once) are kept
beside a CUDA run on an H100 or H200 with the ratio; they are a published table, not a run on this machine.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..params import SamplingParams
from .serve_load import pct

# TensorRT-LLM v1.0, Llama-3.1-8B FP8, output tok/s per GPU at input/output lengths (its perf-overview table).
TRTLLM_LLAMA31_8B_FP8 = {"H100": {(128, 128): 28312, (1000, 1000): 15220, (2048, 2048): 9305},
                         "H200": {(128, 128): 27911, (1000, 1000): 17744, (2048, 2048): 12194}}
DEFAULT_POINTS = "128/128,1000/1000,2048/2048"
# Requests per point in TensorRT-LLM's runs of that table (its perf-overview, "$num_requests": more for short points,
# so that the run reaches a steady state of requests entering and leaving; a run of one wave measures its ramp and
# drain instead). Other points: OTHER_POINT_REQUESTS.
TRTLLM_REQUESTS = {(128, 128): 30000, (128, 2048): 3000, (128, 4096): 1500, (1000, 2000): 1500, (2048, 128): 3000,
                   (2048, 2048): 1500, (5000, 500): 1500, (1000, 1000): 3000, (500, 2000): 3000, (20000, 2000): 1000}
OTHER_POINT_REQUESTS = 1024
CPU_REQUESTS = 32  # a CPU run has no published figure beside it, and 30000 requests would take it days


def point_requests(point: tuple[int, int], requests: int | None, cuda: bool = True) -> int:
    """``requests`` if given, else on CUDA what TensorRT-LLM ran at this point (`TRTLLM_REQUESTS`, or
    OTHER_POINT_REQUESTS), on the CPU CPU_REQUESTS."""
    if requests is not None:
        return requests
    return TRTLLM_REQUESTS.get(point, OTHER_POINT_REQUESTS) if cuda else CPU_REQUESTS


def parse_points(text: str) -> list[tuple[int, int]]:
    """'128/128,1000/1000' -> [(128, 128), (1000, 1000)]; InputError naming a bad entry."""
    points = []
    for item in text.split(","):
        try:
            i, o = (int(x) for x in item.strip().split("/"))
        except ValueError:
            raise InputError(f"--points entry {item.strip()!r} is not INPUT/OUTPUT token counts, e.g. 128/128") from None
        if i < 1 or o < 1:
            raise InputError(f"--points entry {item.strip()!r} needs positive lengths")
        points.append((i, o))
    return points


PREFILL_MODES = ("batched", "per-chunk", "both")


def run_point(engine: Any, input_len: int, output_len: int, requests: int, seed: int = 0) -> dict[str, Any]:
    """N requests of ``input_len`` random ids, ``output_len`` new tokens each, submitted at once."""
    from ..runtime.phase_times import PhaseTimes

    if input_len + output_len > engine.max_seq_len:
        raise InputError(f"point {input_len}/{output_len} needs {input_len + output_len} positions and the bundle holds "
                         f"{engine.max_seq_len}; export with a larger --max-seq-len or drop the point")
    rng = random.Random(seed)  # another seed, other prompts: the prefix cache holds none of them
    prompts = [[rng.randrange(engine.vocab_size) for _ in range(input_len)] for _ in range(requests)]
    stats, kv = engine.scheduler.stats, engine.scheduler.kv
    steps0, rows0, pre0, recomputed0 = stats.decode_steps, stats.decode_rows, stats.preemptions, stats.recomputed_tokens
    stats.peak_running = engine.scheduler.running
    if kv is not None:
        kv.reset_peak()
    params = SamplingParams(max_new_tokens=output_len)
    engine.runner.times = times = PhaseTimes(engine.device)
    t0 = time.perf_counter()
    streams = [engine.submit(p, params, chat=False, stop_ids=[]) for p in prompts]
    for s in streams:
        s.result()
    wall = max(s.token_times[-1] for s in streams) - t0
    engine.runner.times = None
    tokens = sum(len(s.ids) for s in streams)
    ttft = [s.time_to_first_token for s in streams]
    itl = [b - a for s in streams for a, b in zip(s.token_times, s.token_times[1:])]
    steps = stats.decode_steps - steps0

    def ms(xs: list[float], q: float) -> float | None:
        v = pct(xs, q)
        return None if v is None else round(1000 * v, 2)

    return {"input_len": input_len, "output_len": output_len, "requests": requests, "seconds": round(wall, 3),
            "output_tokens": tokens, "output_tok_s": round(tokens / wall, 1), "requests_per_s": round(requests / wall, 3),
            "ttft_ms": {"p50": ms(ttft, 0.5), "p99": ms(ttft, 0.99)},
            "itl_ms": {"p50": ms(itl, 0.5), "p99": ms(itl, 0.99)},
            "mean_decode_batch": round((stats.decode_rows - rows0) / steps, 1) if steps else None,
            "rows": engine.max_sessions, "rows_used_max": stats.peak_running,
            "kv_blocks": kv.blocks if kv is not None else None, "kv_blocks_used_max": kv.peak_used if kv is not None else None,
            "preemptions": stats.preemptions - pre0, "recomputed_tokens": stats.recomputed_tokens - recomputed0,
            "prefill": "batched" if engine.runner.batched_prefill else "per-chunk", "device_time": times.totals()}


def reference_gpu(device_name: str) -> str | None:
    """Which of TensorRT-LLM's table rows a device is ("H100", "H200"), None for others (and the CPU)."""
    return next((k for k in TRTLLM_LLAMA31_8B_FP8 if k in device_name.upper()), None)


def bench_throughput(engine: Any, points: list[tuple[int, int]], requests: int | None, *, command: str,
                     out: Path | None = None, png: Path | None = None, prefill: str = "batched") -> dict[str, Any]:
    """Every point in turn on one engine; the JSON (written to ``out``) and a bar chart (``png``).
    ``requests``: per point (None: `point_requests`' default; each point's JSON says its count). ``prefill``: one of
    `PREFILL_MODES` (batched chunks where the bundle's prefill takes them)."""
    import json

    import torch

    device = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    gpu = reference_gpu(device) if engine.device.type == "cuda" else None
    res: dict[str, Any] = {"command": command, "device": device, "torch": torch.__version__, "bundle": str(engine.path),
                           "requests": requests, "rows": engine.max_sessions, "pool_sizing": engine.pool_sizing,
                           "reference": ("TensorRT-LLM v1.0 published, Llama-3.1-8B FP8, output tok/s per GPU, "
                                         f"{gpu}" if gpu else None), "points": []}
    if prefill not in PREFILL_MODES:
        raise InputError(f"prefill must be one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
    batched = engine.runner.batched_prefill  # False where the bundle's prefill takes one chunk, or deterministic
    modes = {"batched": [batched], "per-chunk": [False], "both": [False, batched] if batched else [False]}[prefill]
    for run, ((i, o), batch) in enumerate((p, m) for p in points for m in modes):
        engine.runner.batched_prefill = batch  # the runner reads it every step; the engine is idle here
        try:
            n = point_requests((i, o), requests, cuda=engine.device.type == "cuda")
            row = run_point(engine, i, o, n, seed=run)  # prompts no earlier run cached
        finally:
            engine.runner.batched_prefill = batched
        ref = TRTLLM_LLAMA31_8B_FP8[gpu].get((i, o)) if gpu else None
        row["trtllm_tok_s"] = ref
        row["vs_trtllm"] = round(row["output_tok_s"] / ref, 2) if ref else None
        res["points"].append(row)
        print(f"point {i}/{o} ({row['prefill']} prefill): {row['output_tok_s']:,.1f} tok/s, device time "
              f"{row['device_time']}", flush=True)
        if out is not None:  # after every point: a long run cut short keeps the points it measured
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(res, indent=1))
    if png is not None:
        plot(res, png)
    return res


def plot(res: dict[str, Any], png: Path) -> None:
    """Output tok/s per point, onecopy beside TensorRT-LLM's published figure where there is one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{p['input_len']}/{p['output_len']}" + ("\n(per chunk)" if p["prefill"] == "per-chunk" else "")
              for p in res["points"]]
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([x - 0.2 for x in xs], [p["output_tok_s"] for p in res["points"]], 0.4, label="onecopy")
    if any(p["trtllm_tok_s"] for p in res["points"]):
        ax.bar([x + 0.2 for x in xs], [p["trtllm_tok_s"] or 0 for p in res["points"]], 0.4,
               label="TensorRT-LLM (published)")
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel("input / output tokens")
    ax.set_ylabel("output tok/s")
    ax.set_title(f"requests at once: {', '.join(str(p['requests']) for p in res['points'])}; {res['device']}")
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def print_table(res: dict[str, Any]) -> None:
    print(f"requests at once (per point below) on {res['device']} ({res['rows']} rows; {res['pool_sizing']})")
    print(f"{'in/out':>11} {'requests':>8} {'tok/s':>9} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} "
          f"{'batch':>6} {'rows':>5} {'blocks':>7} {'preempt':>7} {'prefill':>9} {'pf s':>6} {'dec s':>6} "
          f"{'TRT-LLM':>8} {'x':>5}")
    for p in res["points"]:
        print(f"{p['input_len']:>5}/{p['output_len']:<5} {p['requests']:>8} {p['output_tok_s']:>9,.1f} "
              f"{p['requests_per_s']:>7.2f} "
              f"{p['ttft_ms']['p50']:>9} {p['ttft_ms']['p99']:>9} {p['itl_ms']['p50']:>8} {p['itl_ms']['p99']:>8} "
              f"{p['mean_decode_batch'] or '-':>6} {p['rows_used_max']:>5} {p['kv_blocks_used_max'] or '-':>7} "
              f"{p['preemptions']:>7} {p['prefill']:>9} {phase_seconds(p, 'prefill'):>6} "
              f"{phase_seconds(p, 'decode'):>6} {p['trtllm_tok_s'] or '-':>8} {p['vs_trtllm'] or '-':>5}")


def phase_seconds(point: dict[str, Any], phase: str) -> str:
    t = point["device_time"].get(phase)
    return f"{t['seconds']:.1f}" if t else "-"
