"""Device bytes per extra session vs its state bytes (eager sessions), measured with cudaMemGetInfo.

Usage (CUDA machine, repository root):
    python benchmarks/session_memory_cuda.py --out benchmarks/results/session_memory_h200.json

Exports tiny-llama with a 64k context (16 MiB of KV state per session), opens sessions one by one
and records the device growth of each, side by side with a bare torch.zeros of the same size (the
least any allocation of that state can cost), then closes them and records the return to baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onecopy  # noqa: E402


def used() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # count what is held, not what the caching allocator keeps
    free, total = torch.cuda.mem_get_info()
    return total - free


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "session_memory.json"))
    a = ap.parse_args()
    bundle = onecopy.export("tiny-llama", "/tmp/onecopy-bench/session-memory", max_seq_len=65536, device="cuda",
                            dtype="bfloat16", overwrite=True, progress=False)
    res: dict = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                 "torch": torch.__version__}
    with onecopy.Engine.load(bundle, "cuda", cuda_graphs=False) as engine:
        with engine.open_session() as s:  # warm up kernels and the allocator
            s.prefill([1, 2, 3])
        res["state_bytes_per_session"] = engine.state_bytes_per_session
        res["session_allocation_bytes"] = engine.session_bytes
        base = used()
        sessions, deltas = [], []
        for _ in range(a.sessions):
            before = used()
            sessions.append(engine.open_session())
            deltas.append(used() - before)
        res["device_bytes_per_extra_session"] = deltas
        for s in sessions:
            s.close()
        res["device_bytes_after_closing_all_minus_baseline"] = used() - base
        before = used()
        raw = [torch.zeros(engine.session_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        res["peer_bare_torch_zeros_bytes_for_two"] = used() - before
        del raw
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
