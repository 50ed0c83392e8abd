"""The CPU packed-weight kernel against float32 and torch's own int4 CPU kernel, on SmolLM2's real layers.

Usage (from the repository root, an otherwise idle machine):
    python benchmarks/packed_linear_cpu.py --out benchmarks/results/packed_linear_cpu_smollm2.json

One decode step's projections, in model order (30 layers: wqkv, wo, w13, w2; then the LM head), each with its
own weights, so nothing stays in cache between steps as in a real decode; ms per step (median of --steps),
for M = 1 and 4 rows:
- float32: `F.linear` on the dequantized weights (what a --dequantize bundle reads: 538 MB);
- onecopy: `kernels.cpu.packed_linear` on the packed weights as the bundle stores them (111.6 MB);
- torch int4 (tinygemm CPU): `aten._weight_int4pack_mm_for_cpu` on the same Q4_1 values (scale s, zero m + 8s
  per group of 32, its own packed layout made at load), with float32 rows and, its vectorized path, bfloat16
  rows and scales. It has no 8-bit form with group scales, so it is compared on the 4-bit layers alone (the
  LM head, Q8_0, left out of those rows).
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
import torch.nn.functional as F  # noqa: E402

from onecopy.kernels import cpu  # noqa: E402
from onecopy.models.packed import PackedLayer, dequantize  # noqa: E402
from onecopy.models.quantize import pack_gguf  # noqa: E402
from onecopy.models.source import resolve_source  # noqa: E402


def tinygemm_operands(w) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's int4 CPU operands for a q4a/q4z weight: its packed layout and [K/g, N, 2] scale and zero."""
    q = torch.stack((w.qweight & 0x0F, w.qweight >> 4), dim=-1).reshape(w.out_features, -1).to(torch.int32)
    zero = (w.mins + 8 * w.scales) if w.mins is not None else torch.zeros_like(w.scales)
    sz = torch.stack([w.scales.t(), zero.t()], dim=-1).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), sz


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cpu.load()
    src = resolve_source("smollm2-135m-instruct")
    model = src.build(64, torch.float32)
    pack_gguf(model, src.packed)
    layers = [(name, m.weight) for name, m in model.named_modules() if isinstance(m, PackedLayer)
              and not name.startswith("tok_embeddings")]
    head = model.tok_embeddings.weight  # tied: the LM head reads the embedding table (Q8_0)
    layers.append(("lm_head (tied embedding)", head))
    floats = [dequantize(w) for _, w in layers]
    tiny = [tinygemm_operands(w) if w.layout.startswith("q4") else None for _, w in layers]
    res = {"command": "python " + " ".join(sys.argv), "torch": torch.__version__, "cpu": cpu_name(),
           "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "cores": os.cpu_count(), "threads": torch.get_num_threads(), "layers": len(layers),
           "layouts": sorted({f"{w.layout} g{w.group}" for _, w in layers}),
           "packed_bytes": sum(w.nbytes for _, w in layers), "float_bytes": sum(f.numel() * 4 for f in floats), "rows": []}

    def step_float(xs):
        return [F.linear(x, f) for x, f in zip(xs, floats)]

    def step_packed(xs):
        return [cpu.packed_linear(x, w.layout, w.group, *w.tensors()[:2], w.mins) for x, (_, w) in zip(xs, layers)]

    four = [i for i, (_, w) in enumerate(layers) if w.layout.startswith("q4")]

    def step_packed4(xs):
        return [cpu.packed_linear(xs[i], layers[i][1].layout, layers[i][1].group, *layers[i][1].tensors()[:2],
                                  layers[i][1].mins) for i in four]

    def step_tinygemm4(xs):
        return [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[i], tiny[i][0], layers[i][1].group, tiny[i][1]) for i in four]

    tiny_bf16 = {i: tiny[i][1].bfloat16() for i in four}

    def step_tinygemm4_bf16(xs):  # its vectorized path takes bfloat16 rows (float32 ones run a scalar loop)
        return [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[i].bfloat16(), tiny[i][0], layers[i][1].group,
                                                           tiny_bf16[i]).float() for i in four]

    for m in (1, 4):
        xs = [torch.randn(m, w.in_features) for _, w in layers]
        ref = step_float(xs)
        for what, name, fn in (("all layers", "float32", step_float), ("all layers", "onecopy packed", step_packed),
                               ("4-bit layers", "onecopy packed", step_packed4),
                               ("4-bit layers", "torch int4 (tinygemm CPU)", step_tinygemm4),
                               ("4-bit layers", "torch int4 (tinygemm CPU), bfloat16 rows and scales", step_tinygemm4_bf16)):
            out = fn(xs)
            refs = ref if what == "all layers" else [ref[i] for i in four]
            err = max(((o - r).abs().max() / r.abs().max()).item() for o, r in zip(out, refs))
            times = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                fn(xs)
                times.append(time.perf_counter() - t0)
            res["rows"].append({"rows": m, "layers": what, "kernel": name,
                                "ms_per_step": round(1000 * statistics.median(times), 2),
                                "max_rel_err_vs_float32": float(f"{err:.2e}")})
            print(json.dumps(res["rows"][-1]), flush=True)
    by = {(r["rows"], r["layers"], r["kernel"]): r["ms_per_step"] for r in res["rows"]}
    res["packed_vs_float32_time"] = {m: round(by[(m, "all layers", "onecopy packed")] / by[(m, "all layers", "float32")], 2)
                                     for m in (1, 4)}
    res["packed_vs_tinygemm_time_4bit_layers"] = {
        m: round(by[(m, "4-bit layers", "onecopy packed")] / by[(m, "4-bit layers", "torch int4 (tinygemm CPU)")], 2)
        for m in (1, 4)}
    res["packed_vs_tinygemm_bf16_time_4bit_layers"] = {
        m: round(by[(m, "4-bit layers", "onecopy packed")]
                 / by[(m, "4-bit layers", "torch int4 (tinygemm CPU), bfloat16 rows and scales")], 2) for m in (1, 4)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}))


if __name__ == "__main__":
    main()
