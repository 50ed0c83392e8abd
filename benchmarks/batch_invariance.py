"""How often a session's greedy tokens, batched with S - 1 others, equal its tokens alone.

Usage (from the repository root; CPU or CUDA):
    python benchmarks/batch_invariance.py --device cpu --sessions 16 --out benchmarks/results/batch_invariance_smollm2_cpu.json
    python benchmarks/batch_invariance.py --device cuda --sessions 1,16,64 --out ...   # SmolLM2, real weights
    python benchmarks/batch_invariance.py --device cuda --source llama3-8b --bundle DIR --random-prompts 128 ...

Each of max(S) prompts (chat questions for SmolLM2; random token ids with --random-prompts) runs
alone, greedy, 64 tokens with no early stop; then the first S run at once through the scheduler,
once per S. In the default mode (the fastest decode: BLAS on CPU, cuBLAS past 16 rows on CUDA) and in
deterministic mode (CUDA: the batch-invariant decode, batched; CPU: the decode one row per call).
Reported per mode and S: token-for-token match rate with the solo tokens, sequences identical end
to end, the first divergent positions, and the batched run's generated tokens per second (wall
clock from submit to the last result, prefill included), which gives deterministic mode's cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

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
TOPICS = ["", " Answer briefly.", " Explain it to a child.", " Use one word if you can."]  # 64 distinct chats


def prompts_for(engine: onecopy.Engine, n: int, random_len: int | None) -> list[list[int]]:
    if random_len:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, engine.vocab_size - 1, (n, random_len), generator=g).tolist()
    chats = [q + t for t in TOPICS for q in QUESTIONS]
    return [engine.encode_prompt(chats[i % len(chats)]) for i in range(n)]


def run(bundle: Path, device: str, deterministic: bool, sessions: list[int], tokens: int,
        random_len: int | None) -> dict:
    params = onecopy.SamplingParams(max_new_tokens=tokens)
    with onecopy.Engine.load(bundle, device, max_sessions=max(sessions), deterministic=deterministic) as engine:
        prompts = prompts_for(engine, max(sessions), random_len)
        solo = [engine.submit(p, params, stop_ids=[]).result(timeout=900) for p in prompts]
        out = {"deterministic": deterministic, "decode_method": engine.role_method("decode"), "by_sessions": {}}
        for s in sessions:
            steps, rows = engine.scheduler.stats.decode_steps, engine.scheduler.stats.decode_rows
            t0 = time.perf_counter()
            streams = [engine.submit(p, params, stop_ids=[]) for p in prompts[:s]]
            batched = [st.result(timeout=900) for st in streams]
            seconds = time.perf_counter() - t0
            mean_batch = (engine.scheduler.stats.decode_rows - rows) / max(engine.scheduler.stats.decode_steps - steps, 1)
            same = sum(a == b for x, y in zip(solo, batched) for a, b in zip(x, y))
            first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(solo, batched)]
            out["by_sessions"][str(s)] = {
                "token_match_rate": round(same / (s * tokens), 4), "identical_sequences": sum(d is None for d in first),
                "first_divergence": first, "mean_decode_batch": round(mean_batch, 1),
                "tok_per_s": round(s * tokens / seconds, 2)}
        if not random_len:
            out["solo_answer_0"] = engine.tokenizer.decode(solo[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--bundle", help="default: the embedded SmolLM2 bundle (built once); exported here from --source if absent")
    ap.add_argument("--source", help="export --bundle from this source when it does not exist yet")
    ap.add_argument("--sessions", default="16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--random-prompts", type=int, help="random token-id prompts of this length (random-weight models)")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    bundle = Path(a.bundle) if a.bundle else default_bundle(a.device)
    if a.source and not (bundle / "manifest.json").is_file():
        onecopy.export(a.source, bundle, max_seq_len=a.max_seq_len, device=a.device, progress=False)
    sessions = [int(s) for s in a.sessions.split(",")]
    res = {"command": "python " + " ".join(sys.argv), "tokens": a.tokens, "sessions": sessions,
           "torch": torch.__version__, "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "runs": []}
    for det in (False, True):
        res["runs"].append(run(bundle, a.device, det, sessions, a.tokens, a.random_prompts))
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))
    for r in res["runs"]:
        mode = "deterministic" if r["deterministic"] else "default"
        for s, v in r["by_sessions"].items():
            print(f"{mode:<14} S={s:<3} match {v['token_match_rate']:.4f}  identical {v['identical_sequences']}/{s}  "
                  f"mean batch {v['mean_decode_batch']}  {v['tok_per_s']} tok/s")


if __name__ == "__main__":
    main()
