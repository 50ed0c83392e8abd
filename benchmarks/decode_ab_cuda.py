"""Same-run A/B of two versions of the decode attention kernels (`onecopy/kernels/decode.py`).

Usage (on a CUDA machine, from the repository root):
    git show REV:onecopy/kernels/decode.py > /tmp/decode_before.py
    python benchmarks/decode_ab_cuda.py --before /tmp/decode_before.py --out benchmarks/results/NAME.json

Loads the file named by ``--before`` and the working tree's decode.py as two modules and, on the inputs of
`kv_attention_cuda.inputs` (one layer of the 8B shape, paged, bf16/int8/fp8), times each one's split + merge
launches (CUDA-graph replays, median) and checks that both give the same bits. Shares are of the copy
bandwidth measured in the same run. results/kv_merge_skip_h200.json: before = 2127ea8, after = the split
kernel writing the output when each row has one split, for every format (bf16 since excluded: see its note).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention_cuda import bench, copy_bandwidth  # noqa: E402  (this folder)
from kv_attention_cuda import inputs, share  # noqa: E402

POINTS = [(16, 4096), (64, 1024), (64, 4096), (128, 1024), (256, 1024), (256, 4096)]


def load(name: str, path: Path):
    """decode.py at ``path`` as a module of its own (its relative imports made absolute)."""
    text = path.read_text().replace("from .tiles import", "from onecopy.kernels.tiles import").replace(
        "from ..models.kv_quant import", "from onecopy.models.kv_quant import")
    copy = Path(f"/tmp/onecopy_decode_{name}.py")  # Triton reads a kernel's source from its file
    copy.write_text(text)
    spec = importlib.util.spec_from_file_location(f"onecopy_decode_{name}", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="a decode.py to compare with the working tree's")
    ap.add_argument("--formats", default="bf16,int8,fp8")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    versions = {"before": load("before", a.before), "after": load("after", ROOT / "onecopy/kernels/decode.py")}
    bw = copy_bandwidth()
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "copy_bandwidth_TBps": round(bw / 1e12, 3), "runs": []}
    for fmt in a.formats.split(","):
        for batch, context in POINTS:
            made = inputs(batch, context, fmt)
            row: dict = {"kv": fmt, "batch": batch, "context": context}
            outs = {}
            for name, module in versions.items():
                step = lambda m=module, args=made["args"]: m.launch_decode_paged(*args)  # noqa: E731
                outs[name] = step()
                ms = bench(step, 300)
                row[f"{name}_ms"], row[f"{name}_share"] = round(ms, 4), share(made["needed"], ms, bw)
            row["same_bits"] = bool(torch.equal(outs["before"], outs["after"]))
            row["speedup"] = round(row["before_ms"] / row["after_ms"], 3)
            print(row, flush=True)
            res["runs"].append(row)
            del made, outs
            torch.cuda.empty_cache()
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
