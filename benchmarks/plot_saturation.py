"""The saturation plot from the batched-decode JSONs: decode tok/s against sessions, bf16 vs int8 KV.

Usage (anywhere: it only reads benchmarks/results/):
    python benchmarks/plot_saturation.py --out benchmarks/results/saturation_llama3-8b_h200.png

Left: steady-state decode tok/s (all sessions decoding) of the 8- and 32-layer 8B shape per KV dtype
(batched_decode_llama3-8b[-8l]_{bf16,int8}_h200.json); right: the 32-layer 1000-in / 1000-out output
tok/s (saturation_llama3-8b_{bf16,int8}_h200.json) next to TensorRT-LLM's published H200 figure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TENSORRT_LLM_1000_1000 = 17744  # Llama-3.1-8B, FP8, H200: NVIDIA's published output tok/s


def steady(name: str) -> dict[int, float]:
    rows = json.loads((RESULTS / name).read_text())["results"]["batched"]
    return {int(s): v["decode_tok_s"] for s, v in rows.items() if v.get("decode_tok_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS / "saturation_llama3-8b_h200.png")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    shapes = (("8 layers", "batched_decode_llama3-8b-8l", "--"), ("32 layers", "batched_decode_llama3-8b", "-"))
    for layers, stem, style in shapes:
        for kv, color in (("bf16", "tab:blue"), ("int8", "tab:orange")):
            points = steady(f"{stem}_{kv}_h200.json")
            left.plot(list(points), list(points.values()), style, marker="o", color=color, label=f"{layers}, {kv} KV")
    left.set(xscale="log", xlabel="sessions decoding together", ylabel="decode tok/s (steady window)",
             title="8B shape, 1k prompts + 512 new, H200")
    left.set_xticks([1, 64, 128, 256], labels=["1", "64", "128", "256"])
    left.grid(alpha=0.3)
    left.legend()
    names, values = [], []
    for kv in ("bf16", "int8"):
        run = json.loads((RESULTS / f"saturation_llama3-8b_{kv}_h200.json").read_text())["results"]["batched"]["256"]
        names.append(f"onecopy\n{kv} KV")
        values.append(run["end_to_end_tok_s"])
    names.append("TensorRT-LLM\nFP8 (published)")
    values.append(TENSORRT_LLM_1000_1000)
    right.bar(names, values, color=["tab:blue", "tab:orange", "tab:gray"])
    for i, v in enumerate(values):
        right.text(i, v, f"{v:,.0f}", ha="center", va="bottom")
    right.set(ylabel="output tok/s", title="32 layers, 1000 in / 1000 out")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(a.out)


if __name__ == "__main__":
    main()
