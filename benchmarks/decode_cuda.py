"""Batch-1 decode on CUDA: sessions (issue 3) and CUDA graphs (issue 5), peers measured in the same run.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/decode_cuda.py --source llama-8l-2048 --out benchmarks/results/decode_cuda.json

Measures, on one bundle:
- eager AOTI decode (methods re-pointed per session) vs CUDA-graph replay (one graph per slot)
  vs torch.compile(mode="reduce-overhead") of the eager model, with 1 and with 4 sessions
  interleaved step by step; ms/step, tok/s and the share of the copy-bandwidth floor;
- device bytes per extra session vs its state bytes (eager sessions), and per graph slot.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onecopy  # noqa: E402
from onecopy.models.source import resolve_source  # noqa: E402


def used() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # count what is held, not what the caching allocator keeps
    free, total = torch.cuda.mem_get_info()
    return total - free


def copy_bandwidth() -> float:
    """Device-to-device copy rate, bytes read + written per second (the decode floor's ceiling)."""
    x = torch.empty(2 * 2**30 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * x.element_size() * 10 / (s.elapsed_time(e) / 1000)


def time_steps(step, sessions: int, steps: int) -> float:
    """ms per decode step, each of `sessions` sessions stepped in turn; CUDA events around the loop."""
    for _ in range(3):
        for i in range(sessions):
            step(i)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(steps):
        for i in range(sessions):
            step(i)
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / (steps * sessions)


def onecopy_decode(engine: onecopy.Engine, n_sessions: int, prompt: list[int]):
    sessions = [engine.open_session() for _ in range(n_sessions)]
    toks = []
    for s in sessions:
        toks.append(s.prefill(prompt).argmax(-1))

    def step(i: int) -> None:
        s = sessions[i]
        if s.position >= engine.max_seq_len - 1:
            s.position = len(prompt)  # stay inside the cache; the work per step is the same
        toks[i] = s.decode(toks[i]).argmax(-1)
    return sessions, step


def compile_peer(source, max_seq_len: int, n_sessions: int, prompt: list[int], device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16):
    """torch.compile(mode="reduce-overhead") of the eager model; sessions are module copies sharing weights."""
    base = source.build(max_seq_len, dtype, device)
    models = [base]
    for _ in range(n_sessions - 1):
        m = copy.copy(base)  # shallow: parameters shared; give each its own KV buffers
        m.layers = torch.nn.ModuleList(copy.copy(layer) for layer in base.layers)
        for layer, src in zip(m.layers, base.layers):
            layer.attention = copy.copy(src.attention)
            layer.attention.kv_cache = copy.deepcopy(src.attention.kv_cache)
        models.append(m)
    compiled = torch.compile(base.forward.__func__, mode="reduce-overhead", fullgraph=True)
    toks = []
    with torch.no_grad():
        for m in models:
            m(torch.tensor([prompt], device=device), torch.arange(len(prompt), device=device))
            toks.append(torch.tensor([[1]], device=device))
    pos = [torch.tensor([len(prompt)], device=device) for _ in models]

    def step(i: int) -> None:
        with torch.no_grad():
            out = compiled(models[i], toks[i], pos[i])
            toks[i] = out.argmax(-1, keepdim=True)
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", default="llama-8l-2048")
    ap.add_argument("--bundle", help="bundle directory: reused if it exists, else exported there")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_cuda.json"))
    ap.add_argument("--skip-compile-peer", action="store_true")
    a = ap.parse_args()
    res: dict = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__}
    prompt = list(range(1, 17))
    bundle = Path(a.bundle) if a.bundle else Path("/tmp/onecopy-bench") / f"{a.source}-decode"
    if not (bundle / "manifest.json").is_file():
        t0 = time.perf_counter()
        onecopy.export(a.source, bundle, max_seq_len=a.max_seq_len, device="cuda", overwrite=True, progress=False)
        res["export_s"] = round(time.perf_counter() - t0, 1)
    bw = copy_bandwidth()
    res["copy_bandwidth_TBps"] = round(bw / 1e12, 3)

    # -- eager sessions: memory per session, interleaving cost --------------------------------
    with onecopy.Engine.load(bundle, "cuda", cuda_graphs=False) as eng:
        weight_bytes = eng.memory_report().resident_weight_bytes
        with eng.open_session() as s:
            s.prefill(prompt)
        base = used()
        deltas, opened = [], []
        for _ in range(4):
            before = used()
            opened.append(eng.open_session())
            deltas.append(used() - before)
        for s in opened:
            s.close()
        res["sessions_eager"] = {"state_bytes_per_session": eng.state_bytes_per_session,
                                 "device_bytes_per_extra_session": deltas,
                                 "device_bytes_after_closing_all_minus_before": used() - base}
        floor_ms = None
        for n in (1, 4):
            sessions, step = onecopy_decode(eng, n, prompt)
            ms = time_steps(step, n, a.steps)
            state_read = eng.state_bytes_per_session  # the whole cache is read each step (static shape)
            floor_ms = (weight_bytes + state_read) / bw * 1000
            res[f"eager_aoti_{n}_sessions"] = {"ms_per_step": round(ms, 4), "tok_s": round(1000 / ms, 1)}
            for s in sessions:
                s.close()
        res["floor_ms_at_copy_bandwidth"] = round(floor_ms, 4)

    # -- CUDA graphs: one slot per session ---------------------------------------------------
    before_load = used()
    with onecopy.Engine.load(bundle, "cuda", cuda_graphs=True) as eng:
        slot0 = eng._slots[0]
        res["graph_slot"] = {"first_capture_s": round(slot0.capture_seconds, 3), "device_bytes": slot0.device_bytes,
                             "state_bytes": slot0.state.nbytes, "overhead_bytes": slot0.overhead_bytes}
        for n in (1, 4):
            sessions, step = onecopy_decode(eng, n, prompt)
            ms = time_steps(step, n, a.steps)
            res[f"graph_{n}_sessions"] = {"ms_per_step": round(ms, 4), "tok_s": round(1000 / ms, 1),
                                          "share_of_floor": round(res["floor_ms_at_copy_bandwidth"] / ms, 3)}
            for s in sessions:
                s.close()
        res["graph_slots"] = [{"capture_s": round(s.capture_seconds, 3), "device_bytes": s.device_bytes,
                               "overhead_bytes": s.overhead_bytes} for s in eng._slots]
        res["memory_report"] = str(eng.memory_report())
    res["device_bytes_after_graph_engine_close"] = used() - before_load

    # -- peer: torch.compile reduce-overhead --------------------------------------------------
    if not a.skip_compile_peer:
        src = resolve_source(a.source)
        for n in (1, 4):
            try:
                t0 = time.perf_counter()
                step = compile_peer(src, a.max_seq_len, n, prompt)
                for i in range(n):
                    step(i)
                compile_s = time.perf_counter() - t0
                ms = time_steps(step, n, a.steps)
                res[f"torch_compile_reduce_overhead_{n}_sessions"] = {
                    "ms_per_step": round(ms, 4), "tok_s": round(1000 / ms, 1), "compile_s": round(compile_s, 1)}
            except Exception as e:  # keep the rest of the run
                res[f"torch_compile_reduce_overhead_{n}_sessions"] = {"error": repr(e)[:500]}
    for n in (1, 4):
        e, g = res[f"eager_aoti_{n}_sessions"], res[f"graph_{n}_sessions"]
        g["speedup_vs_eager_aoti"] = round(e["ms_per_step"] / g["ms_per_step"], 3)
    res["interleaved_4_vs_solo_tok_s"] = {
        "eager_aoti": round(res["eager_aoti_4_sessions"]["tok_s"] / res["eager_aoti_1_sessions"]["tok_s"], 3),
        "graph": round(res["graph_4_sessions"]["tok_s"] / res["graph_1_sessions"]["tok_s"], 3)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "memory_report"}, indent=1))
    print(res["memory_report"])


if __name__ == "__main__":
    main()
