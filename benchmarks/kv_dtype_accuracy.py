"""How far an 8-bit KV cache (or FP8 weights) moves a real model: SmolLM2-135M-Instruct (the embedded GGUF's
weights) with its KV cache in the model's dtype, int8 and fp8 (`onecopy export --kv-dtype`), or its
projections in FP8 (`--quantize fp8`, with either cache), over long generations.

Usage (any machine; CPU by default, from the repository root):
    python benchmarks/kv_dtype_accuracy.py --out benchmarks/results/kv_dtype_accuracy_smollm2_cpu.json
    python benchmarks/kv_dtype_accuracy.py --variants fp8-weights,fp8-weights-int8-kv \
        --out benchmarks/results/fp8_weights_accuracy_smollm2_cpu.json

For each prompt, the full-precision cache's engine generates N greedy tokens; then
- teacher-forced: each engine is fed that same token sequence and its logits are compared step by step
  with the full-precision ones (max |logit error| per step, its median and max over the run, and how
  many steps pick the same greedy token);
- free-running: each 8-bit engine generates N greedy tokens on its own; reported is how many tokens
  equal the full-precision run's before the first difference, how many equal overall, and the gap
  between the full-precision run's top two logits where they first differ (a near-tie there means
  any perturbation of that size, not only the cache's, picks the other token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onecopy  # noqa: E402

# variant -> export options, each compared with the model-dtype cache and float weights
VARIANTS = {"int8": {"kv_dtype": "int8"}, "fp8": {"kv_dtype": "fp8"}, "fp8-weights": {"quantize": "fp8"},
            "fp8-weights-int8-kv": {"quantize": "fp8", "kv_dtype": "int8"}}

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain, step by step, how a bill becomes a law in the United States.",
    "List twenty facts about the planets of the solar system, one per line.",
]


def teacher_forced(engine: onecopy.Engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] (fp32) of prefilling ``prompt`` then decoding ``tokens[:-1]``."""
    with engine.open_session() as s:
        out = [s.prefill(prompt).float().reshape(-1)]
        for t in tokens[:-1]:
            out.append(s.decode(torch.tensor([t])).float().reshape(-1))
    return torch.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="smollm2-135m-instruct")
    ap.add_argument("--new-tokens", type=int, default=400)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--work", default="/tmp/onecopy-kv-accuracy")
    ap.add_argument("--variants", default="int8,fp8", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    res: dict = {"command": "python " + " ".join(sys.argv), "source": a.source, "device": a.device,
                 "torch": torch.__version__, "new_tokens": a.new_tokens, "formats": {}}
    engines = {}
    variants = a.variants.split(",")
    for fmt in ["model", *variants]:
        path = Path(a.work) / f"{fmt}-msl{a.max_seq_len}"
        if not (path / "manifest.json").is_file():
            t0 = time.perf_counter()
            onecopy.export(a.source, path, max_seq_len=a.max_seq_len, device=a.device, overwrite=True, progress=False,
                           **VARIANTS.get(fmt, {}))
            print(f"exported {fmt} in {time.perf_counter() - t0:.0f} s", flush=True)
        engines[fmt] = onecopy.Engine.load(path, a.device, max_sessions=2)
    base = engines["model"]
    res["model_dtype"] = base.manifest.dtype
    res["kv_block_bytes"] = {f: e.runner.blocks.block_bytes for f, e in engines.items()}
    greedy = onecopy.SamplingParams(max_new_tokens=a.new_tokens, temperature=0)
    runs = []
    for text in PROMPTS:
        prompt = base.tokenizer.encode(base.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        want = base.submit(prompt, greedy, stop_ids=[]).result()
        ref = teacher_forced(base, prompt, want)
        run = {"prompt": text, "prompt_tokens": len(prompt), "formats": {}}
        for fmt in variants:
            e = engines[fmt]
            got = teacher_forced(e, prompt, want)
            err = (got - ref).abs().amax(-1)
            own = e.submit(prompt, greedy, stop_ids=[]).result()
            first = next((i for i, (x, y) in enumerate(zip(own, want)) if x != y), len(want))
            top = ref[first].topk(2).values if first < len(want) else None
            run["formats"][fmt] = {
                "teacher_forced_max_logit_error": round(float(err.max()), 4),
                "teacher_forced_median_logit_error": round(float(err.median()), 4),
                "teacher_forced_same_greedy_token": int((got.argmax(-1) == ref.argmax(-1)).sum()),
                "free_running_equal_prefix": first,
                "free_running_equal_tokens": sum(x == y for x, y in zip(own, want)),
                "top2_gap_at_first_difference": None if top is None else round(float(top[0] - top[1]), 4),
                "logit_scale": round(float(ref.abs().amax(-1).median()), 3),
            }
            print(fmt, text[:40], run["formats"][fmt], flush=True)
        runs.append(run)
    res["runs"] = runs
    for fmt in variants:
        rs = [r["formats"][fmt] for r in runs]
        res["formats"][fmt] = {
            "max_logit_error": max(r["teacher_forced_max_logit_error"] for r in rs),
            "median_logit_error": statistics.median(r["teacher_forced_median_logit_error"] for r in rs),
            "same_greedy_token": f"{sum(r['teacher_forced_same_greedy_token'] for r in rs)}/{a.new_tokens * len(rs)}",
            "free_running_equal_prefix": [r["free_running_equal_prefix"] for r in rs],
            "top2_gap_at_first_difference": [r["top2_gap_at_first_difference"] for r in rs],
        }
    print(json.dumps(res["formats"], indent=1))
    for e in engines.values():
        e.close()
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
