"""Export, load and generate on CUDA; memory of one shared weight set vs each method owning its weights.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/cuda_memory.py --source llama-8l-2048 --source smollm2-135m-instruct \
        --out benchmarks/results/cuda_memory.json

For each source it exports two bundles with the same code: the onecopy one (weightless methods
bound to one store) and a baseline in which every method is compiled the default way and carries
its own weights. Each is loaded in a fresh subprocess (so device figures are not polluted by the
other) and reports device-level memory (cudaMemGetInfo deltas) next to the summed tensor bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "What is the capital of France?"


def measure(bundle: str, steps: int) -> dict:
    """Runs in a child process: load, one session, greedy generation, memory figures, decode timing."""
    import torch

    import onecopy

    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    t0 = time.perf_counter()
    with onecopy.Engine.load(bundle, "cuda", max_sessions=1) as engine:  # one pool row: weights are what differs
        load_s = time.perf_counter() - t0
        free_loaded, _ = torch.cuda.mem_get_info()
        s = engine.open_session()
        tok = engine.tokenizer
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}])) if engine.manifest.generation.get(
            "chat_template") else list(range(1, 17))
        t0 = time.perf_counter()
        out = list(s.generate_ids(ids, onecopy.SamplingParams(max_new_tokens=steps), stop_ids=[]))
        torch.cuda.synchronize()
        gen_s = time.perf_counter() - t0
        # Steady decode: time many decode steps with events.
        tok_t = torch.tensor([out[-1]], device="cuda")
        s.reset()
        s.prefill(ids)
        for _ in range(5):
            s.decode(tok_t)
        n = 50
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            s.decode(tok_t)
        end.record()
        torch.cuda.synchronize()
        r = engine.memory_report()
        free_after, _ = torch.cuda.mem_get_info()
        result = {
            "text": tok.decode(out), "load_s": round(load_s, 3), "generate_s": round(gen_s, 3),
            "decode_ms_per_step": round(start.elapsed_time(end) / n, 4),
            "device_bytes_after_load": free0 - free_loaded, "device_bytes_with_session": free0 - free_after,
            "report": {k: v for k, v in vars(r).items()}, "report_table": str(r),
        }
    torch.cuda.synchronize()
    result["device_bytes_after_close"] = free0 - torch.cuda.mem_get_info()[0]
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", action="append", required=True)
    ap.add_argument("--work", default="/tmp/onecopy-bench")
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cuda_memory.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(measure(a.child, a.steps)))
        return

    import torch

    import onecopy

    results = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "runs": {}}
    for src in a.source:
        for variant, embed in (("onecopy", ()), ("baseline_each_method_owns_weights", ("prefill", "decode"))):
            out = Path(a.work) / f"{src}-{variant}"
            t0 = time.perf_counter()
            onecopy.export(src, out, max_seq_len=a.max_seq_len, device="cuda", embed_weights=embed, overwrite=True,
                           progress=False)
            export_s = time.perf_counter() - t0
            child = subprocess.run([sys.executable, __file__, "--child", str(out), "--steps", str(a.steps),
                                    "--source", src], capture_output=True, text=True, env=dict(os.environ))
            line = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
            if child.returncode or not line:
                print(child.stdout[-3000:], child.stderr[-3000:])
                res = {"error": child.stderr[-2000:], "rc": child.returncode}
            else:
                res = json.loads(line[0][7:])
            res["export_s"] = round(export_s, 1)
            results["runs"].setdefault(src, {})[variant] = res
            print(f"== {src} / {variant}: export {export_s:.0f}s")
            print(res.get("report_table", res))
            print({k: v for k, v in res.items() if k not in ("report", "report_table")})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print("\nsummary (MiB)            device after load   device +session   resident weights   duplicated   decode ms")
    for src, runs in results["runs"].items():
        for variant, r in runs.items():
            if "report" in r:
                rep = r["report"]
                print(f"{src[:22]:<22} {variant[:8]:<8} {r['device_bytes_after_load'] / 2**20:12.1f} "
                      f"{r['device_bytes_with_session'] / 2**20:16.1f} {rep['resident_weight_bytes'] / 2**20:16.1f} "
                      f"{rep['duplicated_weight_bytes'] / 2**20:12.1f} {r['decode_ms_per_step']:10.3f}")


if __name__ == "__main__":
    main()
