"""Packed weights on CUDA: bf16 vs int8 vs int4 exports of one model, in one run.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/quantized_cuda.py --source llama3-8b-8l --variants bf16,int8:128,int4:128,int4:32 \
        --out benchmarks/results/quantized_llama3-8b-8l_h100.json

With ``--export-only`` each variant's bundle is left in ``--work`` (run one process per variant, in
parallel), and ``--reuse`` benchmarks those bundles. Per variant (loaded alone): device weight bytes; TTFT of a 1k prompt; the
batch-1 decode step at 1k context (the bucket-1 CUDA graph) with its share of the honest floor (the
bytes the step reads: packed values + scales, the filled KV, no embedding table, over the copy
bandwidth measured in this run); the S = 64 decode step (64 sessions at 1k context, one batched
step); and, for the packed variants, the logit error of the compiled engine against the eager model
whose layers are the same packed weights dequantized to bf16 (max |diff| over a prefill and 16 greedy
decode steps, next to the logits' own scale).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onecopy  # noqa: E402
from onecopy.bench.decode import batched_step_ms, copy_bandwidth, decode_step_ms, floor_bytes  # noqa: E402
from onecopy.models.llama import LlamaConfig  # noqa: E402
from onecopy.models.quantize import quantize_model  # noqa: E402
from onecopy.models.source import resolve_source  # noqa: E402


def logit_error(src, bundle: Path, mode: str, group: int, prompt: list[int], max_seq_len: int, steps: int = 16) -> dict:
    """The engine's logits vs the eager model with the same packed layers (dequantized in the graph)."""
    with onecopy.Engine.load(bundle, "cuda", max_sessions=1, cuda_graphs=True) as engine, engine.open_session() as s:
        got = [s.prefill(prompt).float()]
        toks = []
        for _ in range(steps):
            toks.append(int(got[-1].argmax()))
            got.append(s.decode(torch.tensor([toks[-1]], device="cuda")).float())
    model = src.build(max_seq_len, torch.bfloat16, "cuda")
    quantize_model(model, mode, group)
    with torch.no_grad():
        want = [model(torch.tensor([prompt], device="cuda"), torch.arange(len(prompt), device="cuda")).float()]
        for i, t in enumerate(toks):
            want.append(model(torch.tensor([[t]], device="cuda"), torch.tensor([len(prompt) + i], device="cuda")).float())
    del model
    errs = [float((g.reshape(-1) - w.reshape(-1)).abs().max()) for g, w in zip(got, want)]
    agree = sum(int(g.reshape(-1).argmax() == w.reshape(-1).argmax()) for g, w in zip(got, want))
    return {"max_abs_logit_error_per_step": [round(e, 4) for e in errs], "logit_abs_max": round(float(want[0].abs().max()), 3),
            "greedy_agreement": f"{agree}/{len(got)}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", default="llama3-8b-8l")
    ap.add_argument("--variants", default="bf16,int8:128,int4:128,int4:32")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--work", default="/tmp/onecopy-quant")
    ap.add_argument("--out", required=True)
    ap.add_argument("--export-only", action="store_true", help="export the variants' bundles into --work and stop")
    ap.add_argument("--reuse", action="store_true", help="load bundles an --export-only run left in --work")
    a = ap.parse_args()
    src = resolve_source(a.source)
    bw = copy_bandwidth()
    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "source": a.source, "prompt_len": a.prompt_len, "sessions": a.sessions,
           "copy_bandwidth_TBps": round(bw / 1e12, 3), "rows": []}
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, src.config.vocab_size - 1, (a.prompt_len,), generator=g).tolist()
    for variant in a.variants.split(","):
        mode, _, group = variant.partition(":")
        quant = None if mode == "bf16" else mode
        bundle = Path(a.work) / variant.replace(":", "-g")
        t0 = time.perf_counter()
        if not a.reuse:
            onecopy.export(src, bundle, max_seq_len=a.max_seq_len, device="cuda", overwrite=True, progress=False,
                           quantize=quant, group_size=int(group or 128))
            (bundle.parent / f"{bundle.name}.export_s").write_text(f"{time.perf_counter() - t0:.1f}")
        if a.export_only:
            continue
        row = {"variant": variant, "export_s": float((bundle.parent / f"{bundle.name}.export_s").read_text())}
        gc.collect()
        torch.cuda.empty_cache()
        with onecopy.Engine.load(bundle, "cuda", max_sessions=a.sessions, decode_buckets=[1, a.sessions],
                                 prefill_chunk=a.max_seq_len) as engine:
            weights = engine.weights.as_map(engine.manifest.weights)
            cfg = LlamaConfig.from_dict(engine.manifest.config)
            report = engine.memory_report()
            row.update(weight_bytes=report.unique_weight_bytes, packed_weight_bytes=report.packed_weight_bytes,
                       packed_as_float_bytes=report.packed_as_float_bytes)
            ttfts = []
            for i in range(3):  # a different first token each time: no prefix-cache hit
                stream = engine.submit([i + 1] + prompt[1:], onecopy.SamplingParams(max_new_tokens=2), stop_ids=[])
                stream.result(timeout=600)
                ttfts.append(stream.time_to_first_token)
            row["ttft_ms"] = round(1000 * statistics.median(ttfts), 2)
            sessions = []
            for i in range(a.sessions):
                s = engine.open_session()
                s.prefill(prompt[:-1] + [i])  # distinct prompts: no shared prefix blocks at the end
                sessions.append(s)
            step1 = decode_step_ms(engine, sessions[0])
            w, kv = floor_bytes(weights, cfg, a.prompt_len)
            row.update(decode_ms_b1=round(step1, 4), tok_s_b1=round(1000 / step1, 1),
                       floor_ms_b1=round(1000 * (w + kv) / bw, 4), share_of_floor_b1=round(1000 * (w + kv) / bw / step1, 3))
            step_s = batched_step_ms(engine, sessions, steps=50, warmup=3)
            row.update(decode_ms_s=round(step_s, 4), tok_s_s=round(a.sessions * 1000 / step_s, 1),
                       floor_ms_s=round(1000 * (w + a.sessions * kv) / bw, 4))
            for s in sessions:
                s.close()
        if quant is not None:
            row.update(logit_error(src, bundle, quant, int(group or 128), prompt[:256], a.max_seq_len))
        if not a.reuse:
            shutil.rmtree(bundle, ignore_errors=True)
        gc.collect()
        torch.cuda.empty_cache()
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    if a.export_only:
        return
    base = res["rows"][0]
    for r in res["rows"]:
        r["vs_bf16_b1"] = round(r["tok_s_b1"] / base["tok_s_b1"], 3)
        r["vs_bf16_s"] = round(r["tok_s_s"] / base["tok_s_s"], 3)
        r["weights_vs_bf16"] = round(r["weight_bytes"] / base["weight_bytes"], 3)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"{'variant':<10} {'weights GiB':>11} {'TTFT ms':>8} {'b1 tok/s':>9} {'floor%':>7} {'S tok/s':>9} {'vs bf16 b1/S':>13}")
    for r in res["rows"]:
        print(f"{r['variant']:<10} {r['weight_bytes'] / 2**30:>11.2f} {r['ttft_ms']:>8} {r['tok_s_b1']:>9} "
              f"{100 * r['share_of_floor_b1']:>6.1f}% {r['tok_s_s']:>9} {r['vs_bf16_b1']:>6}/{r['vs_bf16_s']}")


if __name__ == "__main__":
    main()
