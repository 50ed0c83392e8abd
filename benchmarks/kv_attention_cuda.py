"""Decode attention at saturation, by KV storage: the paged split-KV kernel over bf16, int8 and fp8 caches.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/kv_attention_cuda.py --out benchmarks/results/kv_attention_h200.json

One layer of the Llama-3-8B shape (32 query heads, 8 KV heads, head_dim 128), pages of 16 positions
(the default export) in shuffled order, a block table of a 4k pool (what a max_seq_len-4096 export
passes), B sessions each of a context drawn in [0.9 L, L]. Each point is the median of CUDA-graph
replays of the kernel pair (split + merge) the exported decode runs, `kernels.paged_decode_attention`
or its ``_q8`` op. Bytes counted: what a step must read, the filled K and V of every session (and
their float32 scales for 8-bit), plus q and the output; the share is against the device-to-device copy
bandwidth measured in the same run. The merge's partial results are not counted (the kernel's own cost).
For 8-bit caches each point also times the CUDA C++ kernel (`kernels.native`, the default where it builds) on the
same inputs, with the same splits (``native_*``; ``speedup_native``: over the Triton kernel).
Each point also times the batch-invariant decode's splits (every split of the table, whatever the batch:
what every decode ran before `tiles.decode_splits`), in the same run. ``--sweep`` times every tile of SWEEP
instead (results/kv_attention_sweep_h200.json: the table behind BLOCK_N_Q8 and DECODE_PROGRAMS).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attention_cuda import bench, copy_bandwidth  # noqa: E402  (this folder: the same timing as its table)

from onecopy.kernels import paged_decode_attention_q8  # noqa: E402  (native where it serves, else Triton)
from onecopy.kernels.decode import launch_decode_paged  # noqa: E402  (what the ops run; takes tile overrides)
from onecopy.models import kv_quant  # noqa: E402

HQ, HKV, D, BS, POOL = 32, 8, 128, 16, 4096


def inputs(batch: int, context: int, fmt: str) -> dict:
    """One layer's decode inputs: B sessions of contexts in [0.9 L, L] over shuffled pages of a ``fmt`` cache."""
    width = POOL // BS
    need = -(-context // BS)  # pages a session of the longest context fills
    blocks = batch * need + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(int(context * 0.9), context + 1, (batch,), device="cuda", generator=g)
    table = torch.full((batch, width), blocks - 1, dtype=torch.long, device="cuda")
    table[:, :need] = torch.randperm(batch * need, device="cuda", generator=g).view(batch, need)
    rows = torch.arange(batch, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    kf = torch.randn(blocks, HKV, BS, D, device="cuda", dtype=torch.bfloat16)
    vf = torch.randn_like(kf)
    if fmt == "bf16":
        k, v, scales, per_position = kf, vf, None, 2 * HKV * D * 2
    else:
        dtype = kv_quant.KV_DTYPES[fmt]
        (k, ks), (v, vs) = kv_quant.quantize(kf, dtype), kv_quant.quantize(vf, dtype)
        scales, per_position = (ks, vs), 2 * HKV * (D + 4)
    return {"args": (q, None, k, v, table, rows, lengths, scales), "filled": int(lengths.sum()),
            "needed": int(lengths.sum()) * per_position + 2 * q.numel() * q.element_size()}


def case(made: dict, batch: int, context: int, fmt: str, tiles: tuple[int, int, int, int] | None = None,
         rep: int = 300, invariant: bool = False, native: bool = False) -> dict:
    """One timing of the split + merge kernels on ``made`` (`inputs`), as a record of the table; ``native``:
    the CUDA C++ kernel's launches instead (8-bit caches)."""
    if native:
        q, _, k, v, table, rows, lengths, (ks, vs) = made["args"]
        ms = bench(lambda: paged_decode_attention_q8(q, k, v, ks, vs, table, rows, lengths, invariant, native=True), rep)
    else:
        ms = bench(lambda: launch_decode_paged(*made["args"], tiles, invariant), rep)
    return {"batch": batch, "context": context, "kv": fmt, "ms": round(ms, 4), "needed_bytes": made["needed"],
            "filled_positions": made["filled"]}


def share(needed_bytes: int, ms: float, bw: float) -> float:
    """The bytes a step must read over its time, as a share of the copy bandwidth ``bw`` (bytes/s)."""
    return round(needed_bytes / (ms / 1000) / bw, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,32,64,128,256")
    ap.add_argument("--contexts", default="1024,2048,4096")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sweep", action="store_true", help="every (split, block, warps, stages) of SWEEP per point")
    ap.add_argument("--formats", default="bf16,int8,fp8")
    ap.add_argument("--no-native", action="store_true", help="skip the CUDA C++ kernel's column")
    a = ap.parse_args()
    bw = copy_bandwidth()
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__,
           "shape": {"heads": HQ, "kv_heads": HKV, "head_dim": D, "page": BS, "pool": POOL},
           "copy_bandwidth_TBps": round(bw / 1e12, 3), "runs": []}
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    if a.sweep:
        return sweep(a, res, bw)
    print(f"{'B':>4} {'ctx':>5} {'kv':<5} {'ms':>8} {'share':>6} {'vs bf16':>8} {'fixed ms':>9} {'share':>6} "
          f"{'native ms':>9} {'share':>6} {'x triton':>8}")
    for batch in map(int, a.batches.split(",")):
        for context in map(int, a.contexts.split(",")):
            base = None
            for fmt in a.formats.split(","):
                made = inputs(batch, context, fmt)
                r = case(made, batch, context, fmt)
                r["share_of_copy_bw"] = share(r["needed_bytes"], r["ms"], bw)
                base = base or r["ms"]
                r["speedup_vs_bf16"] = round(base / r["ms"], 3)
                # The batch-invariant decode's splits (a row's length alone decides them, as every decode's did
                # before `tiles.decode_splits`), in the same run.
                fixed = case(made, batch, context, fmt, invariant=True)
                r["invariant_ms"] = fixed["ms"]
                r["invariant_share_of_copy_bw"] = share(r["needed_bytes"], fixed["ms"], bw)
                line = ""
                if fmt != "bf16" and not a.no_native:
                    nat = case(made, batch, context, fmt, native=True)
                    r["native_ms"] = nat["ms"]
                    r["native_share_of_copy_bw"] = share(r["needed_bytes"], nat["ms"], bw)
                    r["speedup_native"] = round(r["ms"] / nat["ms"], 3)
                    line = f" {nat['ms']:>9.4f} {r['native_share_of_copy_bw']:>6.3f} {r['speedup_native']:>8.2f}"
                res["runs"].append(r)
                print(f"{batch:>4} {context:>5} {fmt:<5} {r['ms']:>8.4f} {r['share_of_copy_bw']:>6.3f} "
                      f"{r['speedup_vs_bf16']:>8.2f} {fixed['ms']:>9.4f} {r['invariant_share_of_copy_bw']:>6.3f}{line}",
                      flush=True)
                del made
                torch.cuda.empty_cache()
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


# (positions per split at most, BLOCK, warps, stages): the split kernel's tiles tried by --sweep.
SWEEP = [(sp, bl, w, st) for sp in (256, 1024, 4096) for bl in (64, 128) for w in (4, 8) for st in (2, 3, 4)]


def sweep(a, res: dict, bw: float) -> None:
    """Each tile of SWEEP at each (format, batch, context), with one split per row's worth of positions per
    program at most (tiles[0]) whatever the batch: the table behind `tiles.BLOCK_N_Q8` and `DECODE_PROGRAMS`."""
    print(f"{'kv':<5} {'B':>4} {'ctx':>5} {'split':>5} {'blk':>4} {'w':>2} {'st':>2} {'ms':>8} {'share':>6}")
    for fmt in a.formats.split(","):
        for batch in map(int, a.batches.split(",")):
            for context in map(int, a.contexts.split(",")):
                made = inputs(batch, context, fmt)
                for tiles in SWEEP:
                    try:
                        r = case(made, batch, context, fmt, tiles, rep=100)
                    except Exception as e:  # a tile that does not compile (shared memory): recorded, skipped
                        res["runs"].append({"batch": batch, "context": context, "kv": fmt, "tiles": tiles,
                                            "error": str(e).splitlines()[0][:200]})
                        continue
                    r["tiles"] = tiles
                    r["share_of_copy_bw"] = share(r["needed_bytes"], r["ms"], bw)
                    res["runs"].append(r)
                    print(f"{fmt:<5} {batch:>4} {context:>5} {tiles[0]:>5} {tiles[1]:>4} {tiles[2]:>2} {tiles[3]:>2} "
                          f"{r['ms']:>8.4f} {r['share_of_copy_bw']:>6.3f}", flush=True)
                del made
                torch.cuda.empty_cache()
                best = max((r for r in res["runs"] if r.get("kv") == fmt and r["batch"] == batch
                            and r["context"] == context and "ms" in r), key=lambda r: r["share_of_copy_bw"])
                print(f"best {fmt} B={batch} ctx={context}: {best['tiles']} {best['share_of_copy_bw']}", flush=True)
                if a.out:  # after every point: a sweep cut short keeps what it measured
                    a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
