"""Packed vs float GGUF weights on the CPU: SmolLM2's decode with its Q4_1/Q8_0 layers kept packed
(read packed by the C++ kernel, `kernels.cpu`) next to the same model exported with float32 weights.

Usage (from the repository root):
    python benchmarks/packed_cpu.py --out benchmarks/results/packed_cpu_smollm2.json

Both bundles are exported into --work (reused when present), then loaded one after the other; each
greedily generates --new-tokens tokens from the same chat prompt, three times; reported: the median
ms per generated token (prefill included, as `onecopy run` pays it), device (host) weight bytes,
and whether both produced the same tokens. The issue's goal: packed <= 1.1x the float time per token,
resident weights <= 130 MB; CPU exports keep GGUF weights packed by default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import onecopy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/onecopy-packed-cpu")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res = {"command": "python " + " ".join(sys.argv), "torch": torch.__version__, "cpu": platform.processor(),
           "cores": os.cpu_count(), "threads": torch.get_num_threads(), "new_tokens": a.new_tokens, "rows": []}
    tokens = {}
    for name, dequantize in (("packed", False), ("float", True)):
        bundle = Path(a.work) / name
        if not (bundle / "manifest.json").is_file():
            onecopy.export("smollm2-135m-instruct", bundle, max_seq_len=256, dequantize=dequantize, overwrite=True,
                           progress=False)
        with onecopy.Engine.load(bundle) as engine:
            ids = engine.tokenizer.encode("What is the capital of France?")
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = list(engine.open_session().generate_ids(ids, onecopy.SamplingParams(max_new_tokens=a.new_tokens),
                                                              stop_ids=[]))
                times.append(time.perf_counter() - t0)
            tokens[name] = out
            report = engine.memory_report()
        res["rows"].append({"weights": name, "ms_per_token": round(1000 * statistics.median(times) / a.new_tokens, 1),
                            "unique_weight_bytes": report.unique_weight_bytes,
                            "packed_weight_bytes": report.packed_weight_bytes})
        print(json.dumps(res["rows"][-1]), flush=True)
    res["same_tokens"] = tokens["packed"] == tokens["float"]
    res["packed_vs_float_time"] = round(res["rows"][0]["ms_per_token"] / res["rows"][1]["ms_per_token"], 2)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))


if __name__ == "__main__":
    main()
