"""Does a projection read faster when its weight was prefetched into L2 while the kernels before it ran?

At batch 1 and 16 the 4096-output projections (o, qkv, down) are latency chains (docs/research/int4_small_m_gemv.md:
o at 0.9 TB/s of its int4 bytes on an H100), and attention before o leaves HBM mostly idle (9.5 us a layer for 1.4
us of bytes). This probe measures, per projection and weight format, a CUDA graph of cold weight copies (as
benchmarks/native_linear_cuda.py) with a sleep kernel standing in for attention before each call:
- base: sleep; projection
- prefetch: a prefetch kernel over the weight's tensors (``prefetch.global.L2`` a 128-byte line, its
  ``::evict_last`` form, or one ``cp.async.bulk.prefetch.L2`` a 4 KB span: ``--mode``); sleep; projection
- hot: the same weight every call (it stays in L2 where it fits: the best a prefetch can do)
and reports the projection's microseconds (the sleep's own time, measured alone, subtracted; the prefetch kernel's
launch stays in: what a decode step would pay).

Usage (a CUDA machine, repository root):
    python benchmarks/l2_prefetch_probe_cuda.py --out benchmarks/results/l2_prefetch_probe_h100.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemv_cuda import SHAPES, cold_copies, graph_ms  # noqa: E402

from onecopy import kernels  # noqa: E402
from onecopy.kernels import native  # noqa: E402
from onecopy.layouts import MMA_LAYOUT_IDS  # noqa: E402
from onecopy.models.packed import tile_ordered  # noqa: E402
from onecopy.models.quantize import quantize_weight  # noqa: E402

MODES = {"normal": 0, "last": 1, "bulk": 2}
PREFETCH_SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
__global__ void prefetch_lines(const char* p, long long n, bool last) {
  for (long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 128; i < n;
       i += (long long)gridDim.x * blockDim.x * 128) {
    if (last) asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p + i));
    else asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i));
  }
}
__global__ void prefetch_bulk(const char* p, long long n) {
  for (long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 4096; i < n;
       i += (long long)gridDim.x * blockDim.x * 4096) {
    const unsigned size = (unsigned)(n - i < 4096 ? n - i : 4096) & ~15u;
    if (size) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + i), "r"(size) : "memory");
  }
}
void prefetch(const std::vector<torch::Tensor>& ts, int64_t mode, int64_t blocks) {
  const bool bulk = mode == 2;
  auto s = c10::cuda::getCurrentCUDAStream().stream();
  for (const auto& t : ts) {
    const long long n = t.numel() * t.element_size();
    if (bulk) prefetch_bulk<<<blocks, 128, 0, s>>>((const char*)t.data_ptr(), n);
    else prefetch_lines<<<blocks, 256, 0, s>>>((const char*)t.data_ptr(), n, mode == 1);
  }
}
"""


def build():
    from torch.utils.cpp_extension import load_inline
    return load_inline("l2_prefetch_probe", cpp_sources="void prefetch(const std::vector<torch::Tensor>& ts, int64_t mode, "
                       "int64_t blocks);", cuda_sources=PREFETCH_SRC, functions=["prefetch"],
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="o,qkv,down,gate_up")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--formats", default="bf16,int4,int8,fp8")
    ap.add_argument("--sleep-us", type=float, default=8.0, help="the stand-in for attention before the projection")
    ap.add_argument("--blocks", type=int, default=132, help="CTAs of the prefetch kernel")
    ap.add_argument("--mode", default="normal", choices=list(MODES),
                    help="prefetch.global.L2 (normal), its evict_last form (last), or cp.async.bulk.prefetch (bulk)")
    a = ap.parse_args()
    native.load()
    ext = build()
    cycles = int(a.sleep_us * torch.cuda.get_device_properties(0).clock_rate / 1000)  # clock_rate in kHz
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
           "sleep_cycles": cycles, "rows": []}
    sleep_us = 1000 * graph_ms([functools.partial(torch.cuda._sleep, cycles)] * 64)
    res["sleep_alone_us"] = round(sleep_us, 2)
    torch.manual_seed(0)
    for shape in a.shapes.split(","):
        n, k, glu, has_res = SHAPES[shape]
        n_out = n // 2 if glu else n
        w = torch.randn(n, k) / k ** 0.5
        for fmt in a.formats.split(","):
            if fmt == "bf16":
                p = w.to("cuda", torch.bfloat16)
                nbytes = p.nbytes
                cps = cold_copies(p, nbytes)
                tensors = [(c,) for c in cps]
            else:
                q = quantize_weight(w, fmt, k if fmt == "fp8" else 128)
                q = q.rebuild(tuple(t.cuda() for t in q.tensors()))
                if fmt != "fp8":
                    q = tile_ordered(q)
                nbytes = q.nbytes
                cps = cold_copies(q, nbytes)
                tensors = [tuple(c.tensors()) for c in cps]
            for m in map(int, a.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                r = torch.randn(m, n_out, device="cuda", dtype=torch.bfloat16) if has_res else None

                def call(c):
                    if fmt == "bf16":
                        return kernels.launch_linear(x, c, r, glu, kernels.small_linear_tiles(n_out, glu))
                    if fmt == "fp8":
                        return native.fp8_linear(x, c.qweight, c.scales)
                    return native.packed_linear(x, c.qweight, c.scales, c.mins, MMA_LAYOUT_IDS[c.layout], c.group,
                                                r, glu)

                def base(c):
                    torch.cuda._sleep(cycles)
                    call(c)

                def pref(c, ts):
                    ext.prefetch(list(ts), MODES[a.mode], a.blocks)
                    torch.cuda._sleep(cycles)
                    call(c)

                def pref_only(ts):
                    ext.prefetch(list(ts), MODES[a.mode], a.blocks)
                    torch.cuda._sleep(cycles)

                row = {"shape": shape, "format": fmt, "rows": m, "MB": round(nbytes / 1e6, 2)}
                row["base_us"] = round(1000 * graph_ms([functools.partial(base, c) for c in cps]) - sleep_us, 2)
                row["prefetch_us"] = round(1000 * graph_ms([functools.partial(pref, c, ts) for c, ts in zip(cps, tensors)])
                                           - sleep_us, 2)
                row["prefetch_kernel_us"] = round(1000 * graph_ms([functools.partial(pref_only, ts) for ts in tensors])
                                                  - sleep_us, 2)
                row["hot_us"] = round(1000 * graph_ms([functools.partial(base, cps[0])] * len(cps)) - sleep_us, 2)
                row["cold_TBps"] = round(nbytes / row["base_us"] / 1e6, 2)
                row["prefetch_gain"] = round(row["base_us"] / row["prefetch_us"], 3)
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
            del cps, tensors
            torch.cuda.empty_cache()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
