"""How often a session's greedy tokens, batched with 15 others, equal its tokens alone (SmolLM2, real weights).

Usage (from the repository root; CPU or CUDA):
    python benchmarks/batch_invariance.py --device cpu --out benchmarks/results/batch_invariance_smollm2_cpu.json

16 chat prompts x 64 greedy tokens (no early stop). Each prompt runs alone, then all 16 run at
once through the scheduler, in the default mode (each step at its own batch size, or the next
graph bucket) and in deterministic mode (every step at the full pool size, each session at its
own row). Reported: token-for-token match rate (positions where the batched token equals the
solo token, over 16 x 64), sequences identical end to end, and the first divergent position.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onecopy  # noqa: E402
from onecopy.defaults import default_bundle  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
    "Write a haiku about the sea.", "What is 12 times 7?", "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.", "What is the boiling point of water?", "Give me a synonym for happy.",
    "What planet is known as the Red Planet?", "Translate 'good morning' into Spanish.", "What is a prime number?",
    "List two uses of a paperclip.", "Why is the sky blue?", "What does a thermometer measure?",
    "Suggest a name for a pet turtle.",
]


def run(bundle: Path, device: str, deterministic: bool, tokens: int) -> dict:
    params = onecopy.SamplingParams(max_new_tokens=tokens)
    with onecopy.Engine.load(bundle, device, max_sessions=16, deterministic=deterministic) as engine:
        prompts = [engine.encode_prompt(q) for q in QUESTIONS]
        solo = [engine.submit(p, params, stop_ids=[]).result(timeout=600) for p in prompts]
        t0 = time.perf_counter()
        streams = [engine.submit(p, params, stop_ids=[]) for p in prompts]
        batched = [s.result(timeout=600) for s in streams]
        wall = time.perf_counter() - t0
        steps = engine.scheduler.stats.decode_steps
        text = engine.tokenizer.decode(solo[0])
    same = sum(a == b for s, t in zip(solo, batched) for a, b in zip(s, t))
    first_diff = [next((i for i, (a, b) in enumerate(zip(s, t)) if a != b), None) for s, t in zip(solo, batched)]
    return {"deterministic": deterministic, "token_match_rate": round(same / (len(prompts) * tokens), 4),
            "identical_sequences": sum(d is None for d in first_diff), "first_divergence": first_diff,
            "batched_wall_s": round(wall, 2), "decode_steps_total": steps, "solo_answer_0": text}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--bundle", help="default: the embedded SmolLM2 bundle (built once)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    bundle = Path(a.bundle) if a.bundle else default_bundle(a.device)
    res = {"command": "python " + " ".join(sys.argv), "prompts": len(QUESTIONS), "tokens": a.tokens,
           "runs": [run(bundle, a.device, det, a.tokens) for det in (False, True)]}
    import torch

    res["torch"] = torch.__version__
    res["device"] = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    for r in res["runs"]:
        mode = "deterministic" if r["deterministic"] else "default"
        print(f"{mode:<14} match {r['token_match_rate']:.4f}  identical {r['identical_sequences']}/16  "
              f"first divergence {r['first_divergence']}")


if __name__ == "__main__":
    main()
