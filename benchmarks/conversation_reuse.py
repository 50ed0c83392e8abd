"""Time to first token over a 10-turn chat: conversations kept on the device vs the history prefilled each turn.

Usage (from the repository root; CPU or CUDA):
    python benchmarks/conversation_reuse.py --device cpu --out benchmarks/results/conversation_reuse_smollm2_cpu.json

The embedded SmolLM2 behind `onecopy serve`'s app (loopback, the official openai client, streaming,
temperature 0, 32 tokens a reply). The same 10 user turns run twice on one engine: with the
conversation cache (each turn continues the previous turn's session: only the new turn is
prefilled) and without (the whole history is prefilled every turn). Replies must be identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

import onecopy  # noqa: E402
from onecopy.defaults import default_bundle  # noqa: E402
from onecopy.serve import BackgroundServer, ServerConfig  # noqa: E402

TURNS = ["Hi! Can you help me plan a trip?", "I want to visit France.", "What is the capital of France?",
         "What should I see there?", "How many days do I need?", "What food should I try?",
         "Is it expensive?", "What is the best season?", "How do I get around the city?", "Thank you for the help!"]


def chat(engine: onecopy.Engine, cache: bool, max_tokens: int) -> dict:
    with BackgroundServer(engine, ServerConfig(model_name="smollm2", conversation_cache=cache)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        history, turns = [], []
        for text in TURNS:
            history.append({"role": "user", "content": text})
            t0 = time.perf_counter()
            ttft, parts, usage = None, [], None
            for ch in client.chat.completions.create(model="smollm2", messages=history, temperature=0,
                                                     max_tokens=max_tokens, stream=True,
                                                     stream_options={"include_usage": True}):
                if ch.choices and ch.choices[0].delta.content:
                    ttft = ttft or time.perf_counter() - t0
                    parts.append(ch.choices[0].delta.content)
                if ch.usage:
                    usage = ch.usage
            reply = "".join(parts)
            history.append({"role": "assistant", "content": reply})
            turns.append({"ttft_ms": round(1000 * ttft, 1), "prompt_tokens": usage.prompt_tokens, "reply": reply})
        state = server.app.state.onecopy
        reused = state.cache.reused_tokens if state.cache else 0
    return {"turns": turns, "prompt_tokens_total": sum(t["prompt_tokens"] for t in turns), "reused_tokens": reused,
            "prefilled_tokens": sum(t["prompt_tokens"] for t in turns) - reused}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--bundle")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    bundle = Path(a.bundle) if a.bundle else default_bundle(a.device)
    with onecopy.Engine.load(bundle, a.device, max_sessions=4) as engine:
        chat(engine, True, 4)  # warm-up
        cached = chat(engine, True, a.max_tokens)
        fresh = chat(engine, False, a.max_tokens)
    import torch

    res = {"command": "python " + " ".join(sys.argv), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "with_conversation_cache": cached, "history_prefilled_each_turn": fresh,
           "replies_identical": [t["reply"] for t in cached["turns"]] == [t["reply"] for t in fresh["turns"]]}
    later = slice(1, None)  # turn 1 has nothing to reuse
    c, f = ([t["ttft_ms"] for t in r["turns"]][later] for r in (cached, fresh))
    res["ttft_ms_turns_2_to_10"] = {"cached_mean": round(sum(c) / len(c), 1), "prefilled_mean": round(sum(f) / len(f), 1),
                                    "cached_last": c[-1], "prefilled_last": f[-1],
                                    "saved_ratio_mean": round(sum(f) / sum(c), 2)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"{'turn':>4} {'prompt tok':>10} {'TTFT cached':>12} {'TTFT prefilled':>15}")
    for i, (x, y) in enumerate(zip(cached["turns"], fresh["turns"]), 1):
        print(f"{i:>4} {x['prompt_tokens']:>10} {x['ttft_ms']:>12} {y['ttft_ms']:>15}")
    print(json.dumps(res["ttft_ms_turns_2_to_10"]), "replies identical:", res["replies_identical"])


if __name__ == "__main__":
    main()
