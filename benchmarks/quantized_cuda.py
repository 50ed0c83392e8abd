"""Packed weights on CUDA: bf16 vs int8 vs int4 vs fp8 exports of one model, next to their peers, in one run.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/quantized_cuda.py --source llama3-8b-8l --variants bf16,int8:128,int4:128,int4:128:triton,fp8 \
        --sessions 16,64 --peers torch.compile,tinygemm --out benchmarks/results/quantized_llama3-8b-8l_h100.json

A variant is mode[:group][:triton][@kv]; ``:triton`` exports without the native CUDA kernels (the Triton packed kernel
in the stored order: what the native kernels replace); ``@int8`` / ``@fp8`` exports an 8-bit KV cache (``kv_dtype``:
how an FP8 deployment runs many sessions, where attention over a bf16 cache bounds any weight format), its floor
counting the 8-bit values and their scales. Peers (``--peers``), measured as onecopy's batch-1 decode
step is (a 1k prompt, then one decode step at a time, CUDA-event timed): ``torch.compile`` (gpt-fast's recipe,
`bench.peers.CompiledPeer`) on the bf16 variant's weights, ``tinygemm`` (the same with torch's int4 GEMM,
`bench.peers.TinygemmPeer`) on the int4:128 variant's own int4 values.

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
from onecopy.bench.decode import batched_step_ms, copy_bandwidth, decode_step_ms, floor_bytes, int4_layers  # noqa: E402
from onecopy.bench.peers import CompiledPeer, TinygemmPeer  # noqa: E402
from onecopy.models.packed import as_float_weights  # noqa: E402
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
    ap.add_argument("--sessions", default="64", help="comma-separated batch sizes of the batched decode step")
    ap.add_argument("--peers", default="", help="comma-separated: torch.compile (bf16), tinygemm (int4:128)")
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
    batches = [int(b) for b in str(a.sessions).split(",")]
    peers = [p for p in a.peers.split(",") if p]
    for variant in a.variants.split(","):
        spec, _, kv_dtype = variant.partition("@")
        mode, _, rest = spec.partition(":")
        group, _, kernels = rest.partition(":")
        quant = None if mode == "bf16" else mode
        bundle = Path(a.work) / variant.replace(":", "-").replace("@", "-kv-")
        t0 = time.perf_counter()
        if not a.reuse:
            onecopy.export(src, bundle, max_seq_len=a.max_seq_len, device="cuda", overwrite=True, progress=False,
                           quantize=quant, group_size=int(group or 128), native_kernels=kernels != "triton",
                           kv_dtype=kv_dtype or None)
            (bundle.parent / f"{bundle.name}.export_s").write_text(f"{time.perf_counter() - t0:.1f}")
        if a.export_only:
            continue
        row = {"variant": variant, "export_s": float((bundle.parent / f"{bundle.name}.export_s").read_text())}
        gc.collect()
        torch.cuda.empty_cache()
        # with a peer: the KV blocks the sessions need (the prompt, then ~60 decode steps a batch size measured), not
        # all free memory, so that the peer's bf16 copy fits beside 256 sessions' blocks
        block = json.loads((bundle / "manifest.json").read_text()).get("kv_block_size") or 0
        positions = a.prompt_len + 64 * (len(batches) + 3)
        kv_blocks = (max(batches) + 1) * -(-positions // block) if block and peers else None
        with onecopy.Engine.load(bundle, "cuda", max_sessions=max(batches), decode_buckets=[1, *batches],
                                 prefill_chunk=a.max_seq_len, kv_blocks=kv_blocks) as engine:
            weights = engine.weights.as_map(engine.manifest.weights)
            cfg = LlamaConfig.from_dict(engine.manifest.config)
            report = engine.memory_report()
            row.update(weight_bytes=report.unique_weight_bytes, packed_weight_bytes=report.packed_weight_bytes,
                       packed_as_float_bytes=report.packed_as_float_bytes,
                       layouts=sorted({p["layout"] for p in engine.manifest.packed.values()}),
                       native_ops=sorted({lib for m in engine.manifest.methods.values() for lib in m.native_ops}))
            ttfts = []
            for i in range(3):  # a different first token each time: no prefix-cache hit
                stream = engine.submit([i + 1] + prompt[1:], onecopy.SamplingParams(max_new_tokens=2), stop_ids=[])
                stream.result(timeout=600)
                ttfts.append(stream.time_to_first_token)
            row["ttft_ms"] = round(1000 * statistics.median(ttfts), 2)
            sessions = []
            for i in range(max(batches)):
                s = engine.open_session()
                s.prefill(prompt[:-1] + [i])  # distinct prompts: no shared prefix blocks at the end
                sessions.append(s)
            step1 = decode_step_ms(engine, sessions[0])
            w, kv = floor_bytes(weights, cfg, a.prompt_len, kv_8bit=engine.manifest.kv_8bit)
            row.update(decode_ms_b1=round(step1, 4), tok_s_b1=round(1000 / step1, 1),
                       floor_ms_b1=round(1000 * (w + kv) / bw, 4), share_of_floor_b1=round(1000 * (w + kv) / bw / step1, 3))
            for b in batches:
                step_s = batched_step_ms(engine, sessions[:b], steps=50, warmup=3)
                row[f"S{b}"] = {"decode_ms": round(step_s, 4), "tok_s": round(b * 1000 / step_s, 1),
                                "floor_ms": round(1000 * (w + b * kv) / bw, 4)}
            for s in sessions:
                s.close()
            if "tinygemm" in peers and variant == "int4:128":
                res["rows"].append(peer_row("tinygemm int4:128", TinygemmPeer(
                    as_float_weights(weights, engine.manifest.packed, torch.bfloat16),
                    int4_layers(weights, engine.manifest.packed), cfg, a.max_seq_len), prompt, w + kv, bw))
            if "torch.compile" in peers and variant == "bf16":
                res["rows"].append(peer_row("torch.compile bf16", CompiledPeer(weights, cfg, a.max_seq_len), prompt,
                                            w + kv, bw))
        if quant is not None and kernels != "triton":
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
    base = next(r for r in res["rows"] if r["variant"] == "bf16")
    for r in res["rows"]:
        r["vs_bf16_b1"] = round(r["tok_s_b1"] / base["tok_s_b1"], 3)
        for b in batches:
            if f"S{b}" in r:
                r[f"S{b}"]["vs_bf16"] = round(r[f"S{b}"]["tok_s"] / base[f"S{b}"]["tok_s"], 3)
        if "weight_bytes" in r:
            r["weights_vs_bf16"] = round(r["weight_bytes"] / base["weight_bytes"], 3)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"{'variant':<20} {'TTFT ms':>8} {'b1 tok/s':>9} {'floor%':>7} {'vs bf16':>8} " +
          " ".join(f"{'S' + str(b) + ' tok/s (x bf16)':>22}" for b in batches))
    for r in res["rows"]:
        print(f"{r['variant']:<20} {r.get('ttft_ms', '-'):>8} {r['tok_s_b1']:>9} {100 * r['share_of_floor_b1']:>6.1f}% "
              f"{r['vs_bf16_b1']:>8} " + " ".join(f"{str(r[f'S{b}']['tok_s']) + ' (' + str(r[f'S{b}']['vs_bf16']) + ')':>22}"
                                               if f"S{b}" in r else f"{'-':>22}" for b in batches))


def peer_row(name: str, peer, prompt: list[int], floor_bytes: int, bw: float, steps: int = 50) -> dict:
    """A peer's batch-1 decode step after a prompt, timed as onecopy's (CUDA events over ``steps`` steps)."""
    dev = torch.device("cuda")
    peer.generate(prompt[:16], 4)  # compiles (and captures) both paths
    with torch.no_grad():
        logits = peer.prefill_fn(torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev))
        tok = logits.argmax(-1, keepdim=True)
        pos = torch.tensor([len(prompt)], device=dev)
        for _ in range(5):
            tok = peer.decode_fn(tok, pos).argmax(-1, keepdim=True)
            pos += 1
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            tok = peer.decode_fn(tok, pos).argmax(-1, keepdim=True)
            pos += 1
        end.record()
        torch.cuda.synchronize()
    ms = start.elapsed_time(end) / steps
    row = {"variant": name, "decode_ms_b1": round(ms, 4), "tok_s_b1": round(1000 / ms, 1),
           "share_of_floor_b1": round(1000 * floor_bytes / bw / ms, 3)}
    print(json.dumps(row), flush=True)
    del peer
    gc.collect()
    torch.cuda.empty_cache()
    return row


if __name__ == "__main__":
    main()
