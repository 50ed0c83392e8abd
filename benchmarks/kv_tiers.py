"""TTFT of a turn on a long history by where its KV blocks are: the device cache, the host tier, the disk tier, or
nowhere (the whole history prefilled again). One process, one bundle, the tiers of `runtime.kv_tiers`.

Usage (CUDA, from the repository root; exports the bundle first when it is missing):
    python benchmarks/kv_tiers.py --source llama3-8b --bundle /root/bundles/l32 --device cuda --reps 4 \
        --out benchmarks/results/kv_tiers_llama3-8b_h100.json
CPU smoke:  python benchmarks/kv_tiers.py --source tiny-llama --device cpu --max-seq-len 64 --history 40 --turn 4

Each case, ``--reps`` times (after one warm-up), submits a history of ``--history`` random ids (one new token: its
blocks published), then the turn: the history, the token it generated and ``--turn`` new ids; its TTFT (submit to
first token, `TokenStream.time_to_first_token`) and how many prompt tokens came from a cache. Cases: device (a cache
hit), host (a filler prompt of the same length evicts the history's blocks first: the engine has the blocks of one
turn and one more, so the turn's loads evict the filler's blocks to the host tier on the way: a full cache's steady
state; ``--pause`` seconds after the filler, as a user's next turn comes later: the idle engine copies the filler's
cached blocks to the host tier meanwhile, so the turn's evictions copy nothing), disk (a restart: the history on one
engine, its blocks saved to the disk tier at close, the turn on a new engine on the same directory, after a warm-up
prompt, with room for the turn (the file reads inside its TTFT timed: ``turn_file_read_ms``); the same files are then
read again alone, timed (page cache warm): ``file_read_ms_p50``; no host tier: the files are read on the turn's way),
restart (the same with a host tier too: the new engine warms it from the disk tier in the background while it serves
the warm-up, `runtime.kv_warm`; where the turn's blocks came from is counted by tier), none (prefix cache off: the
whole turn prefilled). The prefill's work and the blocks' bytes both grow with the layers, but an 8-layer cut's LM
head and fixed host costs are a larger share of the turn's 65-token prefill: the goals are measured on the whole
shape.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onecopy  # noqa: E402
from onecopy.bundle import read_manifest  # noqa: E402
from onecopy.bench.serve_load import pct  # noqa: E402
from onecopy.sampling import SamplingParams  # noqa: E402

ONE = SamplingParams(max_new_tokens=1, temperature=0)


def run_case(bundle: Path, device: str, case: str, a: argparse.Namespace, disk: Path) -> dict:
    manifest = read_manifest(bundle)
    vocab, bs = int(manifest.config["vocab_size"]), manifest.kv_block_size
    blocks = -(-(a.history + a.turn + 1) // bs) + 1  # one history and its turn: a second history evicts the first
    options: dict = {"max_sessions": 2, "kv_blocks": blocks}
    if case == "host":
        options["kv_host_bytes"] = 4 << 30
    elif case == "none":
        options["prefix_cache"] = False
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(10, vocab - 10) for _ in range(n)]  # noqa: E731
    times, cached, restored, reads, turn_reads = [], [], 0, [], []
    by_tier = {"host": 0, "disk": 0}
    if case in ("disk", "restart"):  # a restart: the history's blocks saved at close, the turn on a new engine
        options = {"max_sessions": 2, "kv_blocks": 2 * blocks, "kv_host_bytes": 4 << 30 if case == "restart" else 0,
                   "kv_disk_dir": str(disk)}
        for _ in range(a.reps + 1):
            history = ids(a.history)
            with onecopy.Engine.load(bundle, device, **options) as e:
                reply = e.submit(history, ONE, stop_ids=[]).result()
            with onecopy.Engine.load(bundle, device, **options) as e:
                e.submit(ids(a.history), ONE, stop_ids=[]).result()  # warm-up, with room left for the turn
                index, spent = e.scheduler.kv.tiers, []
                read = index._read  # the turn's file reads, timed: the disk's share inside its TTFT

                def timed(keys, read=read, spent=spent):
                    t0 = time.perf_counter()
                    try:
                        return read(keys)
                    finally:
                        spent.append(time.perf_counter() - t0)
                index._read = timed
                turn = e.submit(history + reply + ids(a.turn), ONE, stop_ids=[])
                turn.result()
                turn_reads.append(sum(spent))
                times.append(turn.time_to_first_token)
                cached.append(turn.cached_tokens)
                stats = e.scheduler.kv.tiers.stats
                restored += stats.restored_disk + stats.restored_host
                by_tier["host"] += stats.restored_host
                by_tier["disk"] += stats.restored_disk
                report = e.memory_report()
                store, n = e.runner.blocks.tiers, a.history // bs  # the files' read alone: the disk's share
                t0 = time.perf_counter()
                assert all(p is not None for p in store.read(store.keys_on_disk()[-n:]))
                reads.append(time.perf_counter() - t0)
    else:
        with onecopy.Engine.load(bundle, device, **options) as e:
            e.submit(ids(a.history), ONE, stop_ids=[]).result()  # warm-up: every shape of the runs below once
            for _ in range(a.reps + 1):
                history = ids(a.history)
                reply = e.submit(history, ONE, stop_ids=[]).result()
                if case == "host":
                    e.submit(ids(a.history), ONE, stop_ids=[]).result()  # evicts the history's blocks
                    assert not e.scheduler.kv.lookup(history, touch=False), "the filler left the history on the device"
                    time.sleep(a.pause)  # the next turn comes later: the idle engine copies the filler's blocks out
                turn = e.submit(history + reply + ids(a.turn), ONE, stop_ids=[])
                turn.result()
                times.append(turn.time_to_first_token)
                cached.append(turn.cached_tokens)
            report = e.memory_report()
            restored = report.kv_tier_restored
    times, cached = times[1:], cached[1:]  # the first of each case: its first restore of these sizes
    extra: dict = {"restored_by_tier": by_tier} if case in ("disk", "restart") else {}
    if reads:  # what the disk gives: the turn's files read again (page cache warm), GB/s; and read in the turn
        extra |= {"turn_file_read_ms": [round(1000 * t, 2) for t in turn_reads[1:]],
                  "file_read_ms_p50": round(1000 * pct(reads[1:], 0.5), 2),
                 "file_read_gb_s": round(a.history // bs * report.kv_block_bytes / pct(reads[1:], 0.5) / 1e9, 2)}
    return {**extra, "case": case, "ttft_ms_p50": round(1000 * pct(times, 0.5), 2),
            "ttft_ms": [round(1000 * t, 2) for t in times],
            "cached_tokens": cached, "kv_block_bytes": report.kv_block_bytes, "kv_blocks": options["kv_blocks"],
            "tier_saved": report.kv_tier_saved, "tier_restored": restored}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--source", default="llama3-8b-8l")
    p.add_argument("--bundle")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-seq-len", type=int, default=8192)
    p.add_argument("--history", type=int, default=4096)
    p.add_argument("--turn", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cases", default="device,host,disk,restart,none")
    p.add_argument("--pause", type=float, default=0.5, help="seconds between the filler and the turn (host case)")
    p.add_argument("--out")
    a = p.parse_args()
    bundle = Path(a.bundle) if a.bundle else Path(tempfile.mkdtemp()) / "bundle"
    if not (bundle / "manifest.json").exists():
        onecopy.export(a.source, bundle, max_seq_len=a.max_seq_len, device=a.device, overwrite=True, progress=False)
    runs = []
    with tempfile.TemporaryDirectory() as disk:
        for case in a.cases.split(","):
            runs.append(run_case(bundle, a.device, case, a, Path(disk)))
            print(runs[-1], flush=True)
    full = next((r["ttft_ms_p50"] for r in runs if r["case"] == "none"), None)
    for r in runs:
        r["ttft_vs_full_prefill"] = round(r["ttft_ms_p50"] / full, 3) if full else None
    import torch

    out = {"command": "python " + " ".join(sys.argv), "source": a.source, "device": a.device,
           "device_name": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "history": a.history, "turn": a.turn, "reps": a.reps, "runs": runs}
    print(json.dumps({r["case"]: r["ttft_vs_full_prefill"] for r in runs}))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
