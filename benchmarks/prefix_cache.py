"""The prefix cache: sessions sharing a system prompt, with and without it, in one process on one bundle.

Usage (CUDA, from the repository root; exports the bundle first when it is missing):
    python benchmarks/prefix_cache.py --source llama3-8b --bundle /root/bundles/llama3-8b-paged \
        --device cuda --out benchmarks/results/prefix_cache_llama3-8b_h100.json
CPU proxy:  python benchmarks/prefix_cache.py --source smollm2-135m-instruct --device cpu \
        --system 512 --question 64 --sessions 8 --out benchmarks/results/prefix_cache_smollm2_cpu.json

Each engine (cache on, then cache off, loaded one after the other on the same bundle) serves:
1. ``--sessions`` sessions: one shared ``--system``-token prompt plus a distinct ``--question``-token
   question each, all submitted at once, 1 new token each, kept open: KV bytes held (device blocks
   referenced: shared once vs per session) and how many such sessions fit in the same KV bytes;
2. TTFT p50 of one request whose system prompt is cached (after 1.) vs the same request without it;
3. decode tok/s while all ``--sessions`` decode ``--new-tokens`` tokens (no early stop): the block
   tables must not slow the step when rows share blocks.
4. multi-turn chat: ``--users`` users x ``--turns`` turns, each turn the whole history plus a new
   question: prompt tokens prefilled in total and TTFT p50.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onecopy  # noqa: E402
from onecopy.bench.serve_load import pct  # noqa: E402
from onecopy.sampling import SamplingParams  # noqa: E402


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def shared_sessions(engine, system, questions) -> dict:
    one = SamplingParams(max_new_tokens=1, temperature=0)
    t0 = time.perf_counter()
    streams = [engine.submit(system + q, one, keep_session=True, stop_ids=[]) for q in questions]
    for s in streams:
        s.result()
    wall = time.perf_counter() - t0
    r = engine.memory_report()
    block = r.kv_block_size
    held = r.kv_shared_bytes + r.kv_private_bytes
    unshared = r.kv_references * engine.runner.blocks.block_bytes  # every session its own copy of its blocks
    out = {"kv_held_bytes": held, "kv_unshared_bytes": unshared, "kv_block_size": block,
           "cached_tokens": [s.cached_tokens for s in streams][:4], "prefill_wall_s": round(wall, 3),
           "sessions_per_kv_bytes_vs_unshared": round(unshared / held, 2) if held else None}
    for s in streams:
        s.session.close()
    return out


def ttft(engine, system, rng, vocab, question, n=8) -> float:
    one = SamplingParams(max_new_tokens=1, temperature=0)
    times = []
    for _ in range(n):
        s = engine.submit(system + tokens(rng, question, vocab), one, stop_ids=[])
        s.result()
        times.append(s.time_to_first_token)
    return round(1000 * pct(times, 0.5), 2)


def decode_rate(engine, system, questions, new_tokens) -> dict:
    """Every session prefilled first (kept), then all decode at once: the steady window is the decode step."""
    one = SamplingParams(max_new_tokens=1, temperature=0)
    first = [engine.submit(system + q, one, keep_session=True, stop_ids=[]) for q in questions]
    for s in first:
        s.result()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0)
    streams = [engine.submit(s.ids[-1:], params, session=s.session, stop_ids=[]) for s in first]
    for s in streams:
        s.result()
    times = [s.token_times for s in streams]
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    n = sum(sum(1 for x in t if start < x <= end) for t in times)
    for s in first:
        s.session.close()
    return {"decode_tok_s": round(n / (end - start), 1) if end > start else None, "window_s": round(end - start, 3)}


def chat(engine, rng, vocab, users, turns, question, answer) -> dict:
    params = SamplingParams(max_new_tokens=answer, temperature=0)
    histories = [tokens(rng, question, vocab) for _ in range(users)]
    prefilled, firsts = 0, []
    for _ in range(turns):
        streams = [engine.submit(h, params, stop_ids=[]) for h in histories]
        for h, s in zip(histories, streams):
            ids = s.result()
            prefilled += len(h) - s.cached_tokens
            firsts.append(s.time_to_first_token)
            h.extend(ids + tokens(rng, question, vocab))
    return {"prefilled_tokens": prefilled, "ttft_ms_p50": round(1000 * pct(firsts, 0.5), 2)}


def measure(bundle, device, prefix_cache, a) -> dict:
    rng = random.Random(0)
    with onecopy.Engine.load(bundle, device, prefix_cache=prefix_cache, max_sessions=a.sessions) as engine:
        vocab = engine.vocab_size
        system = tokens(rng, a.system, vocab)
        questions = [tokens(rng, a.question, vocab) for _ in range(a.sessions)]
        engine.submit(tokens(rng, 32, vocab), SamplingParams(max_new_tokens=2)).result()  # warm up
        out = {"prefix_cache": prefix_cache, "shared": shared_sessions(engine, system, questions)}
        out["ttft_ms_p50_system_cached" if prefix_cache else "ttft_ms_p50"] = ttft(engine, system, rng, vocab, a.question)
        out["decode"] = decode_rate(engine, system, questions, a.new_tokens)
        out["chat"] = chat(engine, rng, vocab, a.users, a.turns, a.question, a.answer)
        out["memory"] = str(engine.memory_report())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="llama3-8b")
    p.add_argument("--bundle")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--system", type=int, default=2048)
    p.add_argument("--question", type=int, default=128)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--answer", type=int, default=32)
    p.add_argument("--rows-bundle", help="also decode on a bundle with one row per session (exported there with "
                                          "--kv-block none when missing): the block tables' cost")
    p.add_argument("--out")
    a = p.parse_args()
    bundle = Path(a.bundle or f"/tmp/onecopy-bench/{a.source}-{a.device}-paged")
    export_s = None
    if not (bundle / "manifest.json").exists():
        t0 = time.perf_counter()
        onecopy.export(a.source, bundle, max_seq_len=a.max_seq_len, device=a.device, overwrite=True, progress=False,
                       methods=("prefill", "decode"))
        export_s = round(time.perf_counter() - t0, 1)
    rows = None
    if a.rows_bundle:
        rb = Path(a.rows_bundle)
        if not (rb / "manifest.json").exists():
            onecopy.export(a.source, rb, max_seq_len=a.max_seq_len, device=a.device, overwrite=True, progress=False,
                           methods=("prefill", "decode"), kv_block=None)
        rng = random.Random(0)
        with onecopy.Engine.load(rb, a.device, max_sessions=a.sessions) as engine:
            vocab = engine.vocab_size
            system = tokens(rng, a.system, vocab)
            questions = [tokens(rng, a.question, vocab) for _ in range(a.sessions)]
            engine.submit(tokens(rng, 32, vocab), SamplingParams(max_new_tokens=2)).result()
            rows = decode_rate(engine, system, questions, a.new_tokens)
    on = measure(bundle, a.device, True, a)
    off = measure(bundle, a.device, False, a)
    res = {"command": " ".join(sys.argv), "source": a.source, "device": a.device, "export_s": export_s,
           "system": a.system, "question": a.question, "sessions": a.sessions, "cache_on": on, "cache_off": off,
           "kv_bytes_ratio": round(on["shared"]["kv_held_bytes"] / off["shared"]["kv_held_bytes"], 3),
           "ttft_cached_over_uncached": round(on["ttft_ms_p50_system_cached"] / off["ttft_ms_p50"], 3),
           "decode_shared_over_unshared": round(on["decode"]["decode_tok_s"] / off["decode"]["decode_tok_s"], 3)
           if on["decode"]["decode_tok_s"] and off["decode"]["decode_tok_s"] else None,
           "chat_prefill_ratio": round(on["chat"]["prefilled_tokens"] / off["chat"]["prefilled_tokens"], 3),
           "decode_rows_bundle": rows,
           "decode_shared_over_rows_bundle": round(on["decode"]["decode_tok_s"] / rows["decode_tok_s"], 3)
           if rows and rows["decode_tok_s"] and on["decode"]["decode_tok_s"] else None}
    if device_name := (__import__("torch").cuda.get_device_name() if a.device == "cuda" else None):
        res["gpu"] = device_name
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
