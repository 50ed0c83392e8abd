"""Quantized skinny linears on CUDA, per Llama-3-8B projection: the native kernels vs bf16 and vs tinygemm.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/native_linear_cuda.py --out benchmarks/results/native_linear_h100.json

As benchmarks/gemv_cuda.py (cold weights: copies enough for 512 MB, one CUDA graph replaying the calls, so a
call's time includes the gaps a decode step's graph has), at 1, 16 and 64 rows, per projection:
- bf16: cuBLAS (``F.linear``) and onecopy's bf16 small-linear kernel (Triton, with the projection's fold);
- int4 g128 (q4a, as ``--quantize int4``), int4 g128 q4z (GGUF Q4_0's arithmetic), int4 g32, int8 g128: the
  Triton packed kernel (stored order) and the native kernel (tile order, `models.mma_order`);
- tinygemm: torch's ``aten._weight_int4pack_mm`` on the same int4 g128 values (what torchao's int4 weight-only
  and gpt-fast run), the live peer;
- fp8 (e4m3, a scale per output feature): the native kernel (rows quantized inside) vs quantize_rows + cuBLAS's
  ``_scaled_mm`` (the path for more rows).
The gate/up projection folds SwiGLU in onecopy's kernels; cuBLAS, tinygemm and the FP8 GEMM write the whole
product (they would need one more kernel). GB/s count the bytes a kernel must read (values + scales).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemv_cuda import SHAPES, cold_copies as copies, graph_ms  # noqa: E402

from onecopy import kernels  # noqa: E402
from onecopy.bench.decode import copy_bandwidth  # noqa: E402
from onecopy.bench.peers import int4_operands  # noqa: E402
from onecopy.kernels import native  # noqa: E402
from onecopy.layouts import LAYOUT_IDS, MMA_LAYOUT_IDS  # noqa: E402
from onecopy.models.packed import Packed, quantize_rows, tile_ordered  # noqa: E402
from onecopy.models.quantize import quantize_weight  # noqa: E402

PACKED = {"int4 g128": ("int4", 128, "q4a"), "int4 g128 q4z": ("int4", 128, "q4z"), "int4 g32": ("int4", 32, "q4a"),
          "int8 g128": ("int8", 128, "q8s")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--rows", default="1,16,64")
    a = ap.parse_args()
    native.load()
    bw = copy_bandwidth()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_TBps": round(bw / 1e12, 3),
           "command": "python " + " ".join(sys.argv), "rows": []}
    torch.manual_seed(0)
    fp8 = torch.cuda.get_device_capability() >= (8, 9)

    for shape in a.shapes.split(","):
        n, k, glu, has_res = SHAPES[shape]
        n_out = n // 2 if glu else n
        w = torch.randn(n, k) / k ** 0.5
        bf = w.to("cuda", torch.bfloat16)
        weights = {"bf16": (bf.nbytes, copies(bf, bf.nbytes))}
        for name, (mode, g, layout) in PACKED.items():
            p = quantize_weight(w, mode, g)
            if layout == "q4z":
                p = Packed("q4z", g, p.qweight, p.scales)
            p = p.rebuild(tuple(t.cuda() for t in p.tensors()))
            weights[name] = (p.nbytes, copies(p, p.nbytes))
            weights[name + " tiles"] = (p.nbytes, copies(tile_ordered(p), p.nbytes))
            if name == "int4 g128":
                tg = int4_operands(p)
                weights["tinygemm"] = (p.nbytes, [(tg[0].clone(), tg[1].clone())
                                                  for _ in range(len(weights[name][1]))])
        if fp8:
            f8 = quantize_weight(w, "fp8", k)
            f8 = f8.rebuild(tuple(t.cuda() for t in f8.tensors()))
            weights["fp8"] = (f8.nbytes, copies(f8, f8.nbytes))
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16) if has_res else None
            nb, bfs = weights["bf16"]
            variants = {"bf16 cuBLAS": (nb, [functools.partial(F.linear, x, c) for c in bfs]),
                        "bf16 small_linear": (nb, [functools.partial(
                            kernels.launch_linear, x, c, r, glu, kernels.small_linear_tiles(n_out, glu)) for c in bfs])}
            for name in PACKED:
                nb, plains = weights[name]
                tri = kernels.packed_linear_tiles(n_out, glu, LAYOUT_IDS[plains[0].layout])
                variants[f"{name} triton"] = (nb, [functools.partial(
                    kernels.launch_linear, x, c.qweight, r, glu, tri, None, 16,
                    (c.scales, c.mins, LAYOUT_IDS[c.layout], c.group)) for c in plains])
                variants[f"{name} native"] = (nb, [functools.partial(
                    native.packed_linear, x, c.qweight, c.scales, c.mins, MMA_LAYOUT_IDS[c.layout], c.group, r, glu)
                    for c in weights[name + " tiles"][1]])
            nb, tgs = weights["tinygemm"]
            variants["tinygemm int4 g128"] = (nb, [functools.partial(torch.ops.aten._weight_int4pack_mm, x, pw, 128, sz)
                                                   for pw, sz in tgs])
            if fp8:
                def scaled(x, c):
                    q, s = quantize_rows(x)
                    return torch._scaled_mm(q, c.qweight.t(), scale_a=s, scale_b=c.scales.reshape(1, -1),
                                            out_dtype=x.dtype)

                nb, f8s = weights["fp8"]
                variants["fp8 native"] = (nb, [functools.partial(native.fp8_linear, x, c.qweight, c.scales) for c in f8s])
                variants["fp8 scaled_mm"] = (nb, [functools.partial(scaled, x, c) for c in f8s])
            row = {"shape": shape, "N": n, "K": k, "rows": m, "us": {}, "GBps": {}}
            for name, (nb, calls) in variants.items():
                try:
                    ms = graph_ms(calls)
                except Exception as e:  # keep the rest
                    row.setdefault("errors", {})[name] = repr(e)[:300]
                    continue
                row["us"][name] = round(1000 * ms, 2)
                row["GBps"][name] = round(nb / ms / 1e6, 1)
            best_bf16 = min(v for kk, v in row["us"].items() if kk.startswith("bf16"))
            row["speedup_vs_best_bf16"] = {kk: round(best_bf16 / v, 2) for kk, v in row["us"].items()}
            if "tinygemm int4 g128" in row["us"] and "int4 g128 native" in row["us"]:
                row["native_int4_vs_tinygemm"] = round(row["us"]["tinygemm int4 g128"] / row["us"]["int4 g128 native"], 2)
            if m == 1 and shape != "lm_head":  # accuracy of both int4 kernels on the same values (float64 reference)
                p = weights["int4 g128"][1][0]
                ref = F.linear(x.double(), (p.scales.repeat_interleave(128, 1).double() * torch.stack(
                    (p.qweight & 15, p.qweight >> 4), -1).reshape(n, k).double() + p.mins.repeat_interleave(128, 1).double()))
                t = weights["int4 g128 tiles"][1][0]
                ours = native.packed_linear(x, t.qweight, t.scales, t.mins, MMA_LAYOUT_IDS[t.layout], t.group)[0] \
                    if not glu else None
                peer = torch.ops.aten._weight_int4pack_mm(x, *weights["tinygemm"][1][0][:1], 128,
                                                          weights["tinygemm"][1][0][1])
                row["max_abs_error_int4"] = {"tinygemm": round(float((peer.double() - ref).abs().max()), 5),
                                             "scale": round(float(ref.abs().max()), 4)}
                if ours is not None:
                    row["max_abs_error_int4"]["native"] = round(float((ours.double() - ref).abs().max()), 5)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(res, indent=1))
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
