"""Many sessions at once on CUDA: batched decode vs one-session-per-step vs transformers' continuous batching.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/batched_decode_cuda.py --source llama3-8b --bundle /root/bundles/llama3-8b \
        --out benchmarks/results/batched_decode_llama3-8b_h200.json

For S = 1, 4, 16, 64 concurrent sessions, each with its own 1024-token prompt and 256 new tokens
(greedy, no early stop), in one process on the same weights:
- onecopy batched: the scheduler decodes every session in one step (CUDA graph per batch size);
- onecopy deterministic: the same with a deterministic engine (the batch-invariant decode: a
  session's tokens never depend on its neighbours), loaded after the default engine is closed;
- onecopy unbatched: the same engine code with max_batch=1 (one session per step, interleaved:
  what onecopy did before batching);
- transformers: `generate_batch` (continuous batching, paged attention) on the engine's own weight
  tensors (split back into q/k/v and gate/up views: no second copy).
Reported per S: aggregate decode tok/s (tokens produced while every session decodes: after the last
session's first token and before the first session's last), inter-token latency p50/p99 per session, time to first
token p50/p99, end-to-end
tok/s (all generated tokens over the whole run, prefill included: the only figure the peer exposes
without per-token timestamps). Plus the engine's memory report (pool, graphs + runners).
Saturation (``--requests N``): N requests submitted at once per count, the engine's rows taking them as
they free (run one count: the largest is the pool's size); the end-to-end tok/s is then the output
throughput of a 1000-in / 1000-out run as TensorRT-LLM reports it (``--prompt-len 1000 --new-tokens 1000``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onecopy  # noqa: E402
from onecopy.bench.decode import weight_layouts  # noqa: E402
from onecopy.bench.serve_load import pct  # noqa: E402
from onecopy.models.source import resolve_source  # noqa: E402


def summarize(starts: list[float], token_times: list[list[float]]) -> dict:
    """Metrics from per-request submit times and per-token arrival times (seconds, one clock)."""
    firsts = [t[0] for t in token_times if t]
    # Steady state: every session is decoding (after the last first token, before the first session ends).
    window_start, window_end = max(firsts), min(t[-1] for t in token_times if t)
    end = max(t[-1] for t in token_times if t)
    in_window = sum(sum(1 for x in t if window_start < x <= window_end) for t in token_times)
    itl = [b - a for t in token_times for a, b in zip(t, t[1:])]
    ttft = [t[0] - s for s, t in zip(starts, token_times) if t]
    total = sum(len(t) for t in token_times)
    return {"generated_tokens": total,
            "decode_tok_s": round(in_window / (window_end - window_start), 1) if window_end > window_start else None,
            "steady_window_s": round(max(window_end - window_start, 0), 3),
            "itl_ms_p50": round(1000 * pct(itl, 0.5), 3) if itl else None,
            "itl_ms_p99": round(1000 * pct(itl, 0.99), 3) if itl else None,
            "ttft_ms_p50": round(1000 * pct(ttft, 0.5), 1), "ttft_ms_p99": round(1000 * pct(ttft, 0.99), 1),
            "end_to_end_tok_s": round(total / (end - min(starts)), 1), "wall_s": round(end - min(starts), 3)}


def run_onecopy(engine: onecopy.Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    params = onecopy.SamplingParams(max_new_tokens=new_tokens)
    streams = [engine.submit(p, params, stop_ids=[]) for p in prompts]
    for s in streams:
        s.result(timeout=900)
    return summarize([s.submitted for s in streams], [s.token_times for s in streams])


def transformers_model(engine: onecopy.Engine):
    """LlamaForCausalLM whose parameters are views of the engine's weight tensors."""
    import transformers

    from onecopy.models.hf_checkpoint import hf_config_from_llama, onecopy_to_hf
    from onecopy.models.llama import LlamaConfig

    cfg = LlamaConfig.from_dict(engine.manifest.config)
    hf_cfg = transformers.LlamaConfig(**hf_config_from_llama(cfg))
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf_cfg)
    sd = onecopy_to_hf(engine.weights.as_map(f for f in engine.manifest.weights if f in engine.weights), cfg)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    assert not unexpected and not missing, (missing, unexpected)
    device = engine.device
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg).to(device)  # fp32 tables, computed (not meta)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    return model.eval()


def run_transformers(model, prompts: list[list[int]], new_tokens: int, eos: int) -> dict:
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    t0 = time.perf_counter()
    try:
        out = model.generate_batch(prompts, generation_config=gc, record_timestamps=True, progress_bar=False)
    except TypeError:  # older releases: no per-token timestamps
        out = model.generate_batch(prompts, generation_config=gc, progress_bar=False)
    t1 = time.perf_counter()
    results = list(out.values())
    generated = sum(len(r.generated_tokens) for r in results)
    res = {"generated_tokens": generated, "end_to_end_tok_s": round(generated / (t1 - t0), 1), "wall_s": round(t1 - t0, 3)}
    if all(getattr(r, "timestamps", None) for r in results):
        res.update({k: v for k, v in summarize([r.created_time for r in results], [r.timestamps for r in results]).items()
                    if k not in ("end_to_end_tok_s", "wall_s", "generated_tokens")})
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", default="llama3-8b")
    ap.add_argument("--bundle", required=True, help="bundle directory: reused if it exists, else exported there")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--sessions", default="1,4,16,64")
    ap.add_argument("--modes", default="batched,unbatched,transformers", help="also: deterministic")
    ap.add_argument("--kv-dtype", default="bf16", choices=["bf16", "int8", "fp8"],
                    help="the KV cache's storage when the bundle is exported here")
    ap.add_argument("--quantize", choices=["int8", "int4", "fp8"],
                    help="the projections' packing when the bundle is exported here (fp8: FP8 GEMMs)")
    ap.add_argument("--no-native-kernels", dest="native_kernels", action="store_false",
                    help="export with the Triton 8-bit decode instead of the CUDA C++ one (the comparison)")
    ap.add_argument("--token-budget", type=int, help="Engine.load(token_budget=): several prompts' prefill chunks "
                    "per iteration (at 128+ sessions one chunk per iteration outlasts the first sessions' decode)")
    ap.add_argument("--requests", type=int, help="saturation: this many requests at once for each count, queued for "
                    "the engine's rows (max_sessions: the largest count); e.g. --sessions 256 --requests 2048 "
                    "--prompt-len 1000 --new-tokens 1000, whose end-to-end tok/s is the output throughput that "
                    "TensorRT-LLM publishes")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    counts = [int(x) for x in a.sessions.split(",")]
    modes = a.modes.split(",")
    res: dict = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "source": a.source, "max_seq_len": a.max_seq_len,
                 "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "kv_dtype": a.kv_dtype, "quantize": a.quantize,
                 "token_budget": a.token_budget,
                 "requests": a.requests, "results": {}}
    bundle = Path(a.bundle)
    if not (bundle / "manifest.json").is_file():
        t0 = time.perf_counter()
        onecopy.export(a.source, bundle, max_seq_len=a.max_seq_len, device="cuda", overwrite=True, progress=False,
                       kv_dtype=a.kv_dtype, quantize=a.quantize, native_kernels=a.native_kernels)
        res["export_s"] = round(time.perf_counter() - t0, 1)
        print("exported in", res["export_s"], "s", flush=True)
    vocab = resolve_source(a.source).config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = {s: torch.randint(0, vocab - 1, (max(s, a.requests or 0), a.prompt_len), generator=g).tolist()
               for s in counts}
    t0 = time.perf_counter()
    engine = onecopy.Engine.load(bundle, "cuda", max_sessions=max(counts), token_budget=a.token_budget)
    res["load_s"] = round(time.perf_counter() - t0, 1)
    res["memory_report"] = str(engine.memory_report())
    res["kv_storage"] = engine.memory_report().kv_dtype  # what the bundle holds (a reused one may differ from --kv-dtype)
    res["weight_layouts"] = weight_layouts(engine.manifest)
    res["native_ops"] = sorted({op for m in engine.manifest.methods.values() for op in m.native_ops})
    r = engine.memory_report()
    res["memory"] = {"weights_bytes": r.resident_weight_bytes, "pool_bytes": r.pool_bytes, "pool_rows": r.pool_rows,
                     "graph_buckets": r.graph_buckets, "graphs_and_runners_bytes": r.graph_bytes,
                     "graph_capture_s": (round(engine.runner.step.graphs.capture_seconds, 2)
                                         if engine.runner.step.graphs else None),
                     "device_used_by_engine_bytes": r.device_used_bytes}
    print(res["memory_report"], flush=True)
    run_onecopy(engine, prompts[counts[0]][:1], 8)  # warm-up: prefill kernels, sampler
    for mode in modes:
        res["results"][mode] = {}
        if mode == "deterministic":  # its own engine, alone on the device
            engine.close()
            engine = onecopy.Engine.load(bundle, "cuda", max_sessions=max(counts), deterministic=True,
                                         token_budget=a.token_budget)
            res["deterministic_decode_method"] = engine.role_method("decode")
            run_onecopy(engine, prompts[counts[0]][:1], 8)
        if mode == "transformers":
            try:
                model = transformers_model(engine)
                run_transformers(model, prompts[counts[0]][:1], 8, vocab - 1)  # warm-up (graph capture)
            except Exception as e:
                res["results"][mode] = {"error": repr(e)[:800]}
                continue
        for s in counts:
            try:
                if mode == "transformers":
                    out = run_transformers(model, prompts[s], a.new_tokens, vocab - 1)
                else:
                    engine.scheduler.max_batch = 1 if mode == "unbatched" else None
                    out = run_onecopy(engine, prompts[s], a.new_tokens)
            except Exception as e:
                out = {"error": repr(e)[:800]}
            res["results"][mode][str(s)] = out
            print(mode, s, out, flush=True)
            Path(a.out).write_text(json.dumps(res, indent=1))
    engine.scheduler.max_batch = None
    base = res["results"].get("batched", {})
    det = res["results"].get("deterministic", {})
    res["deterministic_vs_default_decode"] = {s: round(v["decode_tok_s"] / base[s]["decode_tok_s"], 3)
                                              for s, v in det.items()
                                              if v.get("decode_tok_s") and base.get(s, {}).get("decode_tok_s")}
    solo = base.get(str(counts[0]), {}).get("decode_tok_s")
    if solo:
        res["batched_speedup_vs_1_session"] = {s: round(v["decode_tok_s"] / solo, 2) for s, v in base.items()
                                               if v.get("decode_tok_s")}
        for peer in ("unbatched", "transformers"):
            rows = res["results"].get(peer, {})
            res[f"batched_vs_{peer}_end_to_end"] = {s: round(base[s]["end_to_end_tok_s"] / v["end_to_end_tok_s"], 2)
                                                    for s, v in rows.items() if v.get("end_to_end_tok_s") and s in base}
            res[f"batched_vs_{peer}_decode"] = {s: round(base[s]["decode_tok_s"] / v["decode_tok_s"], 2)
                                                for s, v in rows.items()
                                                if v.get("decode_tok_s") and base.get(s, {}).get("decode_tok_s")}
        itl1 = base.get(str(counts[0]), {}).get("itl_ms_p50")
        res["itl_p50_vs_solo"] = {s: round(v["itl_ms_p50"] / itl1, 2) for s, v in base.items() if v.get("itl_ms_p50")}
    engine.close()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k not in ("memory_report", "results")}, indent=1))
    print(f"{'mode':<13} {'S':>3} {'decode tok/s':>12} {'e2e tok/s':>10} {'ITL p50':>8} {'ITL p99':>8} {'TTFT p50':>9}")
    for mode, rows in res["results"].items():
        for s, v in rows.items() if isinstance(rows, dict) and "error" not in rows else []:
            print(f"{mode:<13} {s:>3} {v.get('decode_tok_s') or '-':>12} {v.get('end_to_end_tok_s') or '-':>10} "
                  f"{v.get('itl_ms_p50') or '-':>8} {v.get('itl_ms_p99') or '-':>8} {v.get('ttft_ms_p50') or '-':>9}")


if __name__ == "__main__":
    main()
