"""Packed weights times many rows on CUDA (a wide decode step, a prefill chunk), per Llama-3-8B projection:
the native packed GEMM (`kernels.native.packed_gemm`, kernels/native/packed_gemm.cu) against what ran before it
(the weight unpacked to bf16 every call, then cuBLAS), the GEMV kernel forced to these rows (batch-invariant
mode), on the H100 / H200 the warpgroup-MMA kernel (`kernels.native.packed_wgmma`), bf16 cuBLAS, and torch's
tinygemm (``aten._weight_int4pack_mm``) on the same int4 values, in one run.

As benchmarks/native_linear_cuda.py: cold weights (copies enough for 512 MB), one CUDA graph replaying the calls,
microseconds per call. Plain products (no folds).

Usage (on a CUDA machine, from the repository root):
    python benchmarks/packed_gemm_cuda.py --rows 16,32,64,128,256 --out benchmarks/results/packed_gemm_h200.json
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

from onecopy.bench.peers import int4_operands  # noqa: E402
from onecopy.kernels import native  # noqa: E402
from onecopy.layouts import MMA_LAYOUT_IDS  # noqa: E402
from onecopy.models.packed import tile_ordered  # noqa: E402
from onecopy.models.quantize import quantize_weight  # noqa: E402

PACKED = {"int4 g128": ("int4", 128), "int8 g128": ("int8", 128)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    ap.add_argument("--rows", default="16,32,64,128,256")
    ap.add_argument("--tinygemm-all-rows", action="store_true", help="time tinygemm past 256 rows too")
    a = ap.parse_args()
    native.load()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python " + " ".join(sys.argv), "rows": []}
    torch.manual_seed(0)
    for shape in a.shapes.split(","):
        n, k, _glu, _res = SHAPES[shape]
        w = torch.randn(n, k, device="cuda") / k ** 0.5
        bf = w.to(torch.bfloat16)
        weights: dict[str, tuple[int, list]] = {"bf16": (bf.nbytes, copies(bf, bf.nbytes))}
        for name, (mode, g) in PACKED.items():
            p = quantize_weight(w, mode, g)
            p = tile_ordered(p)
            weights[name] = (p.nbytes, copies(p, p.nbytes))
            if mode == "int4":
                tg = int4_operands(p)
                weights["tinygemm"] = (p.nbytes, [(tg[0].clone(), tg[1].clone()) for _ in weights[name][1]])
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            nb, bfs = weights["bf16"]
            variants = {"bf16 cuBLAS": (nb, [functools.partial(F.linear, x, c) for c in bfs])}
            for name in PACKED:
                nb, ps = weights[name]
                ops = [(c.qweight, c.scales, c.mins, MMA_LAYOUT_IDS[c.layout], c.group) for c in ps]
                variants[f"{name} gemm"] = (nb, [functools.partial(native.packed_gemm, x, *o) for o in ops])
                if torch.cuda.get_device_capability() == (9, 0):  # the warpgroup-MMA kernel (packed_wgmma.cu)
                    variants[f"{name} wgmma"] = (nb, [functools.partial(native.packed_wgmma, x, *o) for o in ops])
                    if m > 128:  # past 128 rows the kernel picks 128 or 256 rows a CTA: both, for comparison
                        for rows in (128, 256):
                            variants[f"{name} wgmma nb{rows}"] = (nb, [functools.partial(
                                native.packed_wgmma, x, *o, rows) for o in ops])
                variants[f"{name} unpack+cuBLAS"] = (nb, [
                    (lambda o: lambda: F.linear(x, native.unpack(*o, torch.bfloat16)))(o) for o in ops])
                if m <= 64:
                    variants[f"{name} gemv"] = (nb, [functools.partial(
                        native.packed_linear, x, *o[:3], o[3], o[4], None, False, None, True) for o in ops])
            nb, tgs = weights["tinygemm"]
            if m > 256 and not a.tinygemm_all_rows:  # 5-25x slower there: minutes of a GPU session for no news
                tgs = []
            if tgs:
                variants["tinygemm int4 g128"] = (nb, [functools.partial(torch.ops.aten._weight_int4pack_mm, x, pw, 128, sz)
                                                       for pw, sz in tgs])
            row = {"shape": shape, "N": n, "K": k, "rows": m, "us": {}}
            for name, (nb, calls) in variants.items():
                try:
                    row["us"][name] = round(1000 * graph_ms(calls), 2)
                except Exception as e:  # keep the rest
                    row.setdefault("errors", {})[name] = repr(e)[:300]
            bf16 = row["us"].get("bf16 cuBLAS")
            if bf16:
                row["speedup_vs_bf16"] = {kk: round(bf16 / v, 2) for kk, v in row["us"].items()}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(res, indent=1))
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
