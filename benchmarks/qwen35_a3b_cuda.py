"""Qwen3.5-35B-A3B whole (the `qwen3.5-35b-a3b` preset: 40 layers, 256 experts, seeded random weights drawn on the
device) on one GPU: decode at 1 / 16 / 64 sessions, the bytes floor, memory, TTFT, beside ExecuTorch's published
figures; the engine's logits against the eager model with the same (packed) weights.

Usage (on a CUDA machine, from the repository root; export and benchmark in separate processes, as
`benchmarks/quantized_cuda.py` does):
    python benchmarks/qwen35_a3b_cuda.py --quantize int4 --export-only --work /tmp/q35    # ~7.5 min on an H200
    python benchmarks/qwen35_a3b_cuda.py --quantize int4 --reuse --work /tmp/q35 \\
        --out benchmarks/results/qwen35_a3b_int4_h100.json
    python benchmarks/qwen35_a3b_cuda.py --quantize bf16 ...     # the bf16 model (~70 GB): an H200
    python benchmarks/qwen35_a3b_cuda.py --tiny --out /tmp/q35_tiny.json   # the script itself, on the CPU

Per run: the export's seconds (from the --export-only run); the store's weight bytes (packed as stored) and the state
pool's; device memory in use after load + sessions against weights + state (issue 35's goal: within 5%); TTFT of a
``--prompt-len`` prompt (median of 3, distinct first tokens); the batch-1 decode step (the bucket-1 CUDA graph,
CUDA-event timed, at ``--prompt-len`` context) with the bytes it must read (dense weights but the embedding table,
8 of 256 experts of every MoE layer, the shared expert, the recurrent state and the filled KV; packed bytes for
packed weights) over the copy bandwidth measured in this run; each ``--sessions`` batch's step, its tok/s and its
ratio to one session's (goal: 64 sessions >= 20x); ExecuTorch's published decode (A100, HQQ-INT4, CUDA graphs:
98 tok/s; peak memory 17.6 GB) as the anchor. Then, the engine closed, the eager model built with the same weights
(the same draw and packing: `ModelSource.build`) runs a prefill and ``--steps`` greedy steps teacher-forced on its
own tokens: the engine's largest logit error against it and the greedy agreement. transformers cannot hold the
whole model beside it on one GPU: its figures are the 2-layer cut's (`benchmarks/qwen35_moe_cuda.py`).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onecopy  # noqa: E402
from onecopy.bench.decode import batched_step_ms, copy_bandwidth, moe_step_bytes  # noqa: E402
from onecopy.models.quantize import quantize_model  # noqa: E402
from onecopy.models.source import preset_source  # noqa: E402
from onecopy.runtime.memory import device_used  # noqa: E402

EXECUTORCH = {"decode_tok_s": 98.0, "gpu": "A100", "weights": "HQQ-INT4", "peak_memory_GB": 17.6,
              "note": "ExecuTorch CUDA backend, Qwen3.5-35B-A3B, CUDA graphs (published)"}


def engine_logits(engine, prompt: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    with engine.open_session() as s:
        got = [s.prefill(prompt).float().reshape(-1)[-engine.manifest.config["vocab_size"]:].cpu()]
        toks = []
        for _ in range(steps):
            toks.append(int(got[-1].argmax()))
            got.append(s.decode(torch.tensor([toks[-1]], device=engine.device)).float().cpu())
    return got, toks


def eager_logits(model, prompt: list[int], toks: list[int], device: str) -> list[torch.Tensor]:
    """The eager model over the same tokens (teacher-forced on the engine's greedy picks)."""
    def last(x: torch.Tensor) -> torch.Tensor:
        return x.float().reshape(-1, x.shape[-1])[-1].cpu()

    with torch.no_grad():
        want = [last(model(torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device)))]
        for i, tok in enumerate(toks):
            pos = torch.tensor([len(prompt) + i], device=device)
            want.append(last(model(torch.tensor([[tok]], device=device), pos)))
    return want


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantize", default="int4", help="int4, int8, fp8 or bf16 (none)")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--sessions", default="16,64", help="comma-separated batch sizes of the batched decode step")
    ap.add_argument("--steps", type=int, default=16, help="greedy steps of the logit comparison (0: skip it)")
    ap.add_argument("--work", default="/tmp/onecopy-q35")
    ap.add_argument("--out", help="the JSON (not with --export-only)")
    ap.add_argument("--export-only", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="the bundle an --export-only run left in --work")
    ap.add_argument("--tiny", action="store_true", help="the tiny MoE preset on the CPU (checks the script)")
    a = ap.parse_args()
    preset, dev = ("tiny-qwen3.5-moe", "cpu") if a.tiny else ("qwen3.5-35b-a3b", "cuda")
    dtype = torch.float32 if a.tiny else torch.bfloat16
    quant = None if a.quantize in ("bf16", "none") else a.quantize
    if a.tiny:
        a.max_seq_len, a.prompt_len = min(a.max_seq_len, 256), min(a.prompt_len, 100)
    src = preset_source(preset)
    bundle = Path(a.work) / f"{preset}-{a.quantize}"
    if not a.reuse:
        t0 = time.perf_counter()
        onecopy.export(src, bundle, max_seq_len=a.max_seq_len, dtype=dtype, device=dev, quantize=quant,
                       group_size=a.group, overwrite=True, progress=not a.tiny)
        (bundle.parent / f"{bundle.name}.export_s").write_text(f"{time.perf_counter() - t0:.1f}")
    if a.export_only:
        return
    if not a.out:
        ap.error("--out is required unless --export-only")
    cfg = src.config
    res = {"command": "python " + " ".join(sys.argv), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "preset": preset,
           "quantize": a.quantize, "group": a.group if quant else None, "prompt_len": a.prompt_len,
           "max_seq_len": a.max_seq_len, "executorch_published": EXECUTORCH}
    export_s = bundle.parent / f"{bundle.name}.export_s"
    res["export_s"] = float(export_s.read_text()) if export_s.exists() else None
    batches = [int(b) for b in a.sessions.split(",") if b]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size - 1, (a.prompt_len,), generator=g).tolist()
    before = device_used(torch.device(dev))
    with onecopy.Engine.load(bundle, dev, max_sessions=max(batches + [1]), decode_buckets=[1, *batches]) as engine:
        weights = engine.weights.as_map(engine.manifest.weights)
        ttfts = []
        for i in range(3):  # a different first token each time
            stream = engine.submit([i + 1] + prompt[1:], onecopy.SamplingParams(max_new_tokens=2), stop_ids=[])
            stream.result(timeout=1800)
            ttfts.append(stream.time_to_first_token)
        res["ttft_ms"] = round(1000 * statistics.median(ttfts), 2)
        sessions = []
        for i in range(max(batches + [1])):
            s = engine.open_session()
            s.prefill(prompt[:-1] + [i])
            sessions.append(s)
        report = engine.memory_report()
        used = device_used(torch.device(dev)) - before
        res["memory"] = {"weight_bytes": report.unique_weight_bytes, "packed_weight_bytes": report.packed_weight_bytes,
                         "state_pool_bytes": report.pool_bytes, "state_bytes_per_session": report.state_bytes_per_session,
                         "graph_bytes": report.graph_bytes, "workspace_bytes": report.workspace_bytes,
                         "device_used_bytes": used,
                         "used_vs_weights_and_state": round(used / (report.unique_weight_bytes + report.pool_bytes), 3)}
        b1 = batched_step_ms(engine, sessions[:1], 50 if dev == "cuda" else 5, warmup=3)
        need = moe_step_bytes(weights, engine.manifest.state, cfg.num_experts_per_tok, cfg.num_experts, a.prompt_len,
                              tied=cfg.tie_embeddings)
        res.update(decode_ms_b1=round(b1, 4), tok_s_b1=round(1000 / b1, 1), bytes_per_step_b1=need)
        if dev == "cuda":
            bw = copy_bandwidth()
            res["copy_bandwidth_TBps"] = round(bw / 1e12, 3)
            res["floor_ms_b1"] = round(1000 * need["total"] / bw, 4)
            res["share_of_floor_b1"] = round(res["floor_ms_b1"] / b1, 3)
            res["vs_executorch_b1"] = round(res["tok_s_b1"] / EXECUTORCH["decode_tok_s"], 2)
        for b in batches:
            ms = batched_step_ms(engine, sessions[:b], 30 if dev == "cuda" else 3, warmup=3)
            res[f"S{b}"] = {"decode_ms": round(ms, 4), "tok_s": round(b * 1000 / ms, 1),
                            "vs_one_session": round(b * b1 / ms, 2)}
        for s in sessions:
            s.close()
        got, toks = engine_logits(engine, prompt[:256], a.steps) if a.steps else ([], [])
    print(json.dumps({k: v for k, v in res.items() if k != "executorch_published"}), flush=True)
    if a.steps:
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
        model = src.build(a.max_seq_len, dtype, dev, quantize=(quant, a.group) if quant else None)
        if quant and src.random_seed is None:  # stored weights: packed after the build, as the exporter packs them
            quantize_model(model, quant, a.group)
        want = eager_logits(model, prompt[:256], toks, dev)
        del model
        err = max(float((x - y).abs().max()) for x, y in zip(got, want))
        agree = sum(int(x.argmax()) == int(y.argmax()) for x, y in zip(got[1:], want[1:]))
        res["logits_vs_eager"] = {"max_abs_error": round(err, 4), "logit_scale": round(float(want[0].abs().max()), 3),
                                  "greedy_agreement": f"{agree} of {len(toks)}",
                                  "note": "the eager model with the same weights (the same draw and packing), "
                                          "teacher-forced on the engine's greedy tokens"}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("tok_s_b1", "share_of_floor_b1", "ttft_ms", "logits_vs_eager") if k in res}))


if __name__ == "__main__":
    main()
