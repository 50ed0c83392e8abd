"""Prefill attention on CUDA: the Triton kernel over a pool row vs what it replaced and vs SDPA's causal kernel.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/prefill_attention_cuda.py --out benchmarks/results/prefill_attention_h200.json

For each head shape (Llama-3-8B: 32/8 heads of 128; Llama-3.2-1B: 32/8 of 64; Qwen3.5 gated attention:
16/2 of 256) and chunk (a fresh 1k or 8k prompt, a 2k chunk after 6k filled positions), one layer's
attention in a pool of max_seq_len 16k:
- ``row_copy_masked``: the path before (copy of the row's filled prefix + SDPA with a [T, L] mask);
- ``sdpa_causal``: SDPA is_causal on the fresh chunk's own contiguous K/V (what a peer without a pool
  runs on a fresh prompt; not applicable to a chunk after a filled prefix);
- ``triton`` for each tile configuration (BLOCK_M, BLOCK_N, warps, stages): the kernel reading the row
  in place. TFLOP/s count only the causal (visible) score entries.
The fastest tile per head size is what `kernels.PREFILL_TILES` should hold.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from onecopy import kernels  # noqa: E402
from onecopy.models.attention import chunk_attention, read_rows  # noqa: E402

TILES = {
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3),
          (128, 64, 8, 4)],
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 4)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (128, 32, 8, 2), (64, 32, 8, 3)],
}
SHAPES = {128: (32, 8), 64: (32, 8), 256: (16, 2)}
CHUNKS = [("fresh_1k", 0, 1024), ("fresh_8k", 0, 8192), ("chunk_2k_after_6k", 6144, 2048)]


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-seq-len", type=int, default=16384)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "max_seq_len": a.max_seq_len, "rows": [], "best_tiles": {}}
    for d, (hq, hkv) in SHAPES.items():
        kp = torch.randn(2, hkv, a.max_seq_len + 1, d, device="cuda", dtype=torch.bfloat16)
        vp = torch.randn_like(kp)
        rows = torch.tensor([1], device="cuda")
        wins: dict[tuple, float] = {}
        for name, start, t in CHUNKS:
            q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
            pos = torch.arange(start, start + t, device="cuda")
            ctx = torch.arange(start + t, device="cuda")
            flops = 4 * d * hq * sum(range(start + 1, start + t + 1))
            ref = chunk_attention(q.transpose(0, 1)[None], read_rows(kp, rows, start + t),
                                  read_rows(vp, rows, start + t), pos[None], ctx)[0].transpose(0, 1)
            row = {"head_dim": d, "q_heads": hq, "kv_heads": hkv, "chunk": name, "tokens": t, "start": start}
            row["row_copy_masked_ms"] = round(timed(lambda: chunk_attention(
                q.transpose(0, 1)[None], read_rows(kp, rows, start + t), read_rows(vp, rows, start + t), pos[None],
                ctx)), 4)
            if start == 0:
                kf, vf = kp[1, :, :t][None].contiguous(), vp[1, :, :t][None].contiguous()
                qf = q.transpose(0, 1)[None].contiguous()
                row["sdpa_causal_ms"] = round(timed(lambda: F.scaled_dot_product_attention(
                    qf, kf, vf, is_causal=True, enable_gqa=hq != hkv)), 4)
            for tiles in TILES[d]:
                try:
                    out = kernels.launch_prefill(q, kp, vp, rows, pos, tiles)
                    err = float((out.float() - ref.float()).norm() / ref.float().norm())
                    ms = timed(lambda: kernels.launch_prefill(q, kp, vp, rows, pos, tiles))
                except Exception as e:  # a tile that does not fit (shared memory): record and go on
                    row[f"triton_{tiles}"] = repr(e)[:120]
                    continue
                row[f"triton_{tiles}_ms"] = round(ms, 4)
                row[f"triton_{tiles}_rel_err"] = round(err, 5)
                row[f"triton_{tiles}_tflops"] = round(flops / ms / 1e9, 1)
                if err < 2e-2:
                    wins[tiles] = wins.get(tiles, 0.0) + ms
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        best = min(wins, key=wins.get)
        res["best_tiles"][d] = {"tiles": best, "sum_ms_over_chunks": round(wins[best], 4)}
        print(d, "best", best, flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
