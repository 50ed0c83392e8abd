"""`onecopy bench`: batch-1 generation on one GPU, onecopy next to its peers, on the same weights, in one process.

For each prompt length: time to first token, decode ms/token, tok/s, the share of the honest
bandwidth floor, device peak memory; plus export and compile times. The floor is the bytes one
decode step must read (every weight except the embedding table, which decode gathers one row of,
unless it doubles as the LM head; plus the K/V of the filled context) over the device-to-device
copy bandwidth measured in the same run. Writes JSON, a table and a PNG plot.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..models.llama import LlamaConfig
from ..runtime.memory import device_used


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (median of 20)."""
    x = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y.copy_(x)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1000)
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2**31 / statistics.median(times)


def floor_bytes(weights: dict[str, Any], cfg: LlamaConfig, context: int, kv_8bit: bool = False) -> tuple[int, int]:
    """(weight bytes a decode step reads, KV bytes it reads at ``context`` filled positions); ``kv_8bit``: a cache of
    8-bit values with a float32 scale per position and head (``kv_dtype`` int8 / fp8)."""
    nbytes = {k: v.numel() * v.element_size() for k, v in weights.items()}
    w = sum(nbytes.values())
    if not cfg.tie_embeddings:  # gathered one row, not read (float, or packed from a GGUF)
        w -= sum(n for f, n in nbytes.items() if f.startswith("tok_embeddings."))
    itemsize = weights["norm.weight"].element_size()  # the model dtype (the KV's)
    per_head = cfg.head_dim + 4 if kv_8bit else cfg.head_dim * itemsize
    kv = cfg.n_layers * 2 * cfg.n_kv_heads * per_head * context
    return w, kv


def moe_step_bytes(weights: dict[str, Any], state: dict[str, Any], top_k: int, n_experts: int, context: int,
                   tied: bool = False) -> dict[str, int]:
    """What one batch-1 decode step of a MoE model must read (Qwen3.5 MoE): every weight but the embedding table
    (unless ``tied``: it is the LM head too), packed values, scales and mins as stored; of the routed-expert stacks
    (FQNs with ``.experts.``) the ``top_k`` of ``n_experts`` a token uses; the recurrent state (`Manifest.state`
    specs with ``recurrent``) and the KV of ``context`` filled positions."""
    nb = {k: v.numel() * v.element_size() for k, v in weights.items()}
    experts = {k: v for k, v in nb.items() if ".experts." in k}
    table = () if tied else ("embed_tokens.", "tok_embeddings.")  # decode gathers one row of it
    dense = sum(v for k, v in nb.items() if k not in experts and not k.startswith(table))
    routed = sum(experts.values()) * top_k // n_experts
    recurrent = sum(s.nbytes for s in state.values() if s.recurrent)
    kv = sum(s.nbytes * context // s.shape[1] for s in state.values() if not s.recurrent)
    return {"dense_weights": dense, "routed_experts": routed, "all_experts": sum(experts.values()),
            "recurrent_state": recurrent, "kv_filled": kv, "total": dense + routed + recurrent + kv}


class DevicePeak:
    """Device-level peak use around a block: use at entry plus the allocator's peak growth inside it."""

    def __enter__(self) -> "DevicePeak":
        self.start_used = device_used(torch.device("cuda", torch.cuda.current_device()))
        self.start_reserved = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        self.peak = self.start_used + max(torch.cuda.max_memory_reserved() - self.start_reserved, 0)


def _row(name: str, prompt_len: int, ttft_s: float, step_ms: float, floor_ms: float, peak: int, **extra) -> dict:
    return {"system": name, "prompt_len": prompt_len, "ttft_ms": round(1000 * ttft_s, 2),
            "decode_ms_per_token": round(step_ms, 4), "tok_s": round(1000 / step_ms, 1),
            "share_of_floor": round(floor_ms / step_ms, 3), "floor_ms": round(floor_ms, 4),
            "device_peak_bytes": peak, **extra}


def run_onecopy(engine, prompt: list[int], new_tokens: int) -> tuple[float, float, float]:
    """(TTFT s, ms/token through the scheduler, ms/token of the decode graph alone at that context)."""
    from ..params import SamplingParams

    stream = engine.submit(prompt, SamplingParams(max_new_tokens=new_tokens), stop_ids=[])
    stream.result(timeout=1800)
    itl = [b - a for a, b in zip(stream.token_times, stream.token_times[1:])]
    # The graph alone: replay the bucket-1 decode at this context (what the step costs on the device).
    with engine.open_session() as s:
        s.position = len(prompt)
        graph_ms = decode_step_ms(engine, s)
    return stream.time_to_first_token, 1000 * statistics.mean(itl), graph_ms


def weight_layouts(manifest) -> list[str]:
    """The packed layouts a bundle's projections use (`layouts.LAYOUTS`), or ["float"]: what a benchmark's
    JSON records of the weights it ran."""
    return sorted({p["layout"] for p in manifest.packed.values()}) or ["float"]


def decode_step_ms(engine, session, steps: int = 100, warmup: int = 5) -> float:
    """Device ms of one batch-1 decode step of ``session`` at its position (the bucket-1 graph where
    captured), the mean of ``steps`` back-to-back steps timed with CUDA events. The position is not
    advanced: every step reads the same context."""
    return batched_step_ms(engine, [session], steps, warmup)


def batched_step_ms(engine, sessions: list, steps: int = 100, warmup: int = 5) -> float:
    """`decode_step_ms` for ``sessions`` decoding together in one step (their batch size's graph); on a CPU engine
    the host's clock (the benchmarks' dry runs)."""
    rows, positions = [s.row for s in sessions], [s.position for s in sessions]
    tok = torch.ones(len(rows), dtype=torch.long, device=engine.device)
    for _ in range(warmup):
        engine.runner.decode(rows, positions, tok)
    if engine.device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.runner.decode(rows, positions, tok)
        return 1000 * (time.perf_counter() - t0) / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        engine.runner.decode(rows, positions, tok)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


PEERS = ("torch.compile", "transformers", "tinygemm")


def default_peers(quantize: str | None) -> str:
    """The peers `onecopy bench` runs unless told: torch.compile and transformers on the (dequantized) weights,
    and for an int4 bundle tinygemm on its int4 values too."""
    return "torch.compile,transformers" + (",tinygemm" if quantize == "int4" else "")


def int4_layers(weights: dict[str, torch.Tensor], packed: dict[str, dict[str, Any]]) -> dict[str, tuple]:
    """The 4-bit projections of a bundle (its manifest's ``packed``) as `peers.TinygemmPeer` takes them."""
    from ..models.packed import Packed
    from .peers import int4_operands

    out = {}
    for name, p in packed.items():
        if p["layout"].startswith(("q4a", "q4z")) and not name.startswith("tok_embeddings"):
            out[name] = int4_operands(Packed(p["layout"], p["group"], weights[f"{name}.qweight"],
                                             weights[f"{name}.scales"], weights.get(f"{name}.mins")))
    if not out:
        raise ValueError("the tinygemm peer runs an int4 bundle's values: export with --quantize int4")
    return out


def bench_decode(source: str, bundle: Path, *, prompt_lens: list[int], max_seq_len: int, new_tokens: int,
                 peers: list[str], out_dir: Path, tag: str, command: str, quantize: str | None = None,
                 group_size: int = 128) -> dict[str, Any]:
    from ..export.exporter import export
    from ..bundle import read_manifest
    from ..models.packed import as_float_weights
    from ..runtime.engine import Engine
    from .peers import CompiledPeer, TinygemmPeer, TransformersPeer

    res: dict[str, Any] = {"command": command, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "source": source, "max_seq_len": max_seq_len, "new_tokens": new_tokens, "rows": []}
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{Path(source).name}_{tag}"

    def save() -> None:  # after every row: a run cut short still leaves what it measured
        (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=1))
    if not (bundle / "manifest.json").is_file():
        t0 = time.perf_counter()
        export(source, bundle, max_seq_len=max_seq_len, device="cuda", overwrite=True, progress=False,
               quantize=quantize, group_size=group_size)
        res["onecopy_export_s"] = round(time.perf_counter() - t0, 1)
        import gc

        gc.collect()
        torch.cuda.empty_cache()  # the export's model and activations: not the engine's memory
    manifest = read_manifest(bundle)
    cfg = LlamaConfig.from_dict(manifest.config)
    bw = copy_bandwidth()
    res["copy_bandwidth_TBps"] = round(bw / 1e12, 3)
    g = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, cfg.vocab_size - 1, (n,), generator=g).tolist() for n in prompt_lens}

    def floor_ms(n: int) -> tuple[float, dict]:
        w, kv = floor_bytes(weights, cfg, n + new_tokens // 2, manifest.kv_8bit)  # the mean context over the decode
        return 1000 * (w + kv) / bw, {"weight_bytes_read": w, "kv_bytes_read": kv}

    t0 = time.perf_counter()
    with DevicePeak() as load_peak:
        engine = Engine.load(bundle, "cuda", max_sessions=1, prefill_chunk=max_seq_len)
    res["onecopy_load_s"] = round(time.perf_counter() - t0, 1)
    weights = engine.weights.as_map(engine.manifest.weights)
    res["quantize"] = (quantize or "gguf") if engine.manifest.packed else None
    res["weights"] = {"total_bytes": sum(t.nbytes for t in weights.values()),
                      "embedding_bytes": sum(t.nbytes for f, t in weights.items() if f.startswith("tok_embeddings.")),
                      "tied_embeddings": cfg.tie_embeddings}
    run_onecopy(engine, prompts[prompt_lens[0]][:16], 8)  # warm-up
    for n in prompt_lens:
        run_onecopy(engine, prompts[n], new_tokens)  # warm this length as the peers are (first-use kernel loading)
        with DevicePeak() as peak:
            ttft, ms, graph_ms = run_onecopy(engine, prompts[n], new_tokens)
        f, fb = floor_ms(n)
        res["rows"].append(_row("onecopy", n, ttft, ms, f, max(peak.peak, load_peak.peak), graph_ms=round(graph_ms, 4),
                                graph_share_of_floor=round(f / graph_ms, 3), **fb))
        print(res["rows"][-1], file=sys.stderr, flush=True)
        save()
    # The peers run a float model: of packed weights, their values dequantized (the same model).
    peer_weights = as_float_weights(weights, engine.manifest.packed, weights["norm.weight"].dtype)
    for name in peers:
        try:
            t0 = time.perf_counter()
            if name == "torch.compile":
                peer = CompiledPeer(peer_weights, cfg, max_seq_len)
            elif name == "tinygemm":
                peer = TinygemmPeer(peer_weights, int4_layers(weights, engine.manifest.packed), cfg, max_seq_len)
            else:
                peer = TransformersPeer(peer_weights, cfg, max_seq_len)
            peer.generate(prompts[prompt_lens[0]], 4)  # compiles (prefill shapes recompile per length: warmed below)
            res[f"{name}_compile_s"] = round(time.perf_counter() - t0, 1)
            for n in prompt_lens:
                peer.generate(prompts[n], new_tokens)  # warm this length, whatever it compiles or captures
                with DevicePeak() as peak:
                    if name in ("torch.compile", "tinygemm"):
                        ttft, times = peer.generate(prompts[n], new_tokens)
                        ms = 1000 * statistics.mean(b - a for a, b in zip(times, times[1:]))
                    else:
                        ttft, ms = peer.generate(prompts[n], new_tokens)
                f, fb = floor_ms(n)
                res["rows"].append(_row(name, n, ttft, ms, f, peak.peak, **fb))
                print(res["rows"][-1], file=sys.stderr, flush=True)
                save()
            del peer
            torch.cuda.empty_cache()
        except Exception as e:  # keep the rest of the run
            res[f"{name}_error"] = repr(e)[:800]
            print(name, "failed:", repr(e)[:300], file=sys.stderr, flush=True)
    engine.close()
    by = {(r["system"], r["prompt_len"]): r for r in res["rows"]}
    res["onecopy_vs_best_peer"] = {}
    for n in prompt_lens:
        others = [by[(p, n)] for p in peers if (p, n) in by]
        if (("onecopy", n) in by) and others:
            best_tok = max(o["tok_s"] for o in others)
            best_ttft = min(o["ttft_ms"] for o in others)
            res["onecopy_vs_best_peer"][str(n)] = {"tok_s_ratio": round(by[("onecopy", n)]["tok_s"] / best_tok, 3),
                                                   "ttft_ratio": round(by[("onecopy", n)]["ttft_ms"] / best_ttft, 3)}
    save()
    plot(res, out_dir / f"{stem}.png")
    return res


def plot(res: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    systems = list(dict.fromkeys(r["system"] for r in res["rows"]))
    lens = sorted({r["prompt_len"] for r in res["rows"]})
    by = {(r["system"], r["prompt_len"]): r for r in res["rows"]}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(systems), 1)
    for i, s in enumerate(systems):
        xs = [j + i * width for j in range(len(lens))]
        axes[0].bar(xs, [by.get((s, n), {}).get("tok_s", 0) for n in lens], width, label=s)
        axes[1].bar(xs, [by.get((s, n), {}).get("ttft_ms", 0) for n in lens], width, label=s)
    for ax, title in zip(axes, ("decode tok/s (batch 1)", "time to first token (ms)")):
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(lens))], [str(n) for n in lens])
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
    axes[0].legend(loc="lower center")
    fig.suptitle(f"{res['source']} on {res['device']} (max_seq_len {res['max_seq_len']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_table(res: dict[str, Any]) -> None:
    print(f"{'system':<14} {'prompt':>6} {'TTFT ms':>9} {'ms/tok':>8} {'tok/s':>7} {'floor%':>7} {'peak GiB':>9}")
    for r in res["rows"]:
        print(f"{r['system']:<14} {r['prompt_len']:>6} {r['ttft_ms']:>9} {r['decode_ms_per_token']:>8} {r['tok_s']:>7} "
              f"{100 * r['share_of_floor']:>6.1f}% {r['device_peak_bytes'] / 2**30:>9.2f}")
    print(json.dumps(res.get("onecopy_vs_best_peer", {})))
