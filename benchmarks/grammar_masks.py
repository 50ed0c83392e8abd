"""What a step's grammar masks cost on the host: llguidance's allowed-token bitmasks for N constrained rows, one
matcher after another (what `sampling.BatchSampler.fill_masks` does) against llguidance's parallel fill over its
thread pool (`llguidance.numpy.fill_next_token_bitmask_par`), and the rows' advance by one token each.

Usage (from the repository root):
    python benchmarks/grammar_masks.py --rows 1,8,32,64 --out benchmarks/results/grammar_masks_<machine>.json

The tokenizer is the random presets' byte-level one with a 128,256-id vocabulary (the 8B shape's, as
benchmarks/structured_overhead.py runs); the schema is structured_overhead.py's. Each row walks its grammar with
tokens drawn from its own mask (a fixed seed); microseconds a step are the mean over --steps steps after a first
step (warm-up) left out. Both ways give
the same masks (checked every step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from structured_overhead import SCHEMA  # noqa: E402

from onecopy.grammar import Grammar, GrammarCompiler  # noqa: E402
from onecopy.models.source import byte_tokenizer_json  # noqa: E402

VOCAB = 128256


def main() -> None:
    import llguidance
    import llguidance.numpy as lnp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp()) / "tokenizer.json"
    path.write_text(byte_tokenizer_json(VOCAB))
    grammars = GrammarCompiler(path, [VOCAB - 1], VOCAB)
    grammar = Grammar.json_schema(SCHEMA)
    threads = llguidance.LLExecutor()
    words = (VOCAB + 31) // 32
    rows = []
    for n in (int(r) for r in args.rows.split(",")):
        serial = [grammars.matcher(grammar) for _ in range(n)]
        par = [grammars.matcher(grammar) for _ in range(n)]
        rng = random.Random(0)
        t_serial = t_par = t_advance = 0.0
        for step in range(args.steps + 1):
            timed = step > 0  # the first: warm-up
            a, b = np.zeros((n, words), np.int32), np.zeros((n, words), np.int32)
            t = time.perf_counter()
            for i, m in enumerate(serial):
                m.fill(a[i])
            t_serial += (time.perf_counter() - t) * timed
            t = time.perf_counter()
            lnp.fill_next_token_bitmask_par(threads, [(m._m, i) for i, m in enumerate(par)], b)
            t_par += (time.perf_counter() - t) * timed
            assert (a == b).all()
            tokens = []
            for i in range(n):
                allowed = np.nonzero(np.unpackbits(a[i].view(np.uint8), bitorder="little"))[0]
                tokens.append(int(rng.choice(list(allowed[allowed < VOCAB]))))
            t = time.perf_counter()
            for m, tok in zip(serial, tokens):
                m.advance(tok)
            t_advance += (time.perf_counter() - t) * timed
            for m, tok in zip(par, tokens):
                m.advance(tok)
        row = {"rows": n, "serial_fill_us": round(t_serial / args.steps * 1e6, 1),
               "parallel_fill_us": round(t_par / args.steps * 1e6, 1),
               "advance_us": round(t_advance / args.steps * 1e6, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = {"command": " ".join(sys.argv), "cpus": len(os.sched_getaffinity(0)), "vocab": VOCAB, "schema": SCHEMA,
           "steps": args.steps, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
