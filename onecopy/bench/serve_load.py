"""`onecopy bench serve`: N concurrent streaming clients against the OpenAI endpoint (like `vllm bench serve`).

Each concurrency level runs a bounded number of requests (fixed-length random token prompts, a
fixed number of output tokens with ignore_eos) through /v1/completions with stream=true, over
loopback. Per level: request throughput, output tok/s, time to first token and inter-token latency
p50/p99. When the server runs in this process, the same requests also go straight to the engine's
scheduler (no HTTP) at the same concurrency: the peer that shows what the HTTP layer costs.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass
class _Result:
    ttft: float
    itl: list[float]
    tokens: int
    ok: bool


def pct(xs: list[float], q: float) -> float | None:
    """The ``q`` quantile of ``xs`` (nearest rank), None when empty."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _one(http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]) -> _Result:
    t0 = time.perf_counter()
    times = []
    tokens = 0
    async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return _Result(0.0, [], 0, False)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                times.append(time.perf_counter())
            elif event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if not times:
        return _Result(0.0, [], tokens, False)
    return _Result(times[0] - t0, [b - a for a, b in zip(times, times[1:])], tokens, True)


def _summary(results: list[_Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl]
    tokens = sum(r.tokens for r in ok)
    return {"requests": len(results), "completed": len(ok), "refused": len(results) - len(ok),
            "wall_s": round(wall, 3), "request_throughput_per_s": round(len(ok) / wall, 3),
            "output_tok_s": round(tokens / wall, 1),
            "ttft_ms_p50": _ms(pct([r.ttft for r in ok], 0.5)), "ttft_ms_p99": _ms(pct([r.ttft for r in ok], 0.99)),
            "itl_ms_p50": _ms(pct(itl, 0.5)), "itl_ms_p99": _ms(pct(itl, 0.99))}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 3)


async def run_http(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                   api_key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue = list(prompts)
    results: list[_Result] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        async def client() -> None:
            while queue:
                prompt = queue.pop()
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                        "ignore_eos": True, "stream_options": {"include_usage": True}}
                results.append(await _one(http, url, body, headers))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return _summary(results, time.perf_counter() - t0)


async def run_direct(engine: Any, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict[str, Any]:
    """The same load straight to the scheduler: the peer without HTTP, JSON or SSE."""
    from ..params import SamplingParams

    queue = list(prompts)
    results: list[_Result] = []
    params = SamplingParams(max_new_tokens=max_tokens)

    async def client() -> None:
        while queue:
            stream = engine.submit(queue.pop(), params, stop_ids=[])
            t0 = time.perf_counter()
            async for _ in stream:
                pass
            times = stream.token_times
            results.append(_Result(times[0] - t0, [b - a for a, b in zip(times, times[1:])], len(times), True))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return _summary(results, time.perf_counter() - t0)


def bench_serve(*, url: str | None, engine: Any, model: str, levels: list[int], requests_per_client: int,
                prompt_len: int, max_tokens: int, vocab: int, api_key: str | None, out: Path | None,
                command: str) -> dict[str, Any]:
    """Run every concurrency level (HTTP, and direct when ``engine`` is given); write and return the JSON."""
    rng = random.Random(0)
    res: dict[str, Any] = {"command": command, "url": url, "model": model, "prompt_len": prompt_len,
                           "max_tokens": max_tokens, "requests_per_client": requests_per_client, "levels": {}}
    if engine is not None:
        import torch

        res["device"] = torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu"
        res["torch"] = torch.__version__
        res["max_sessions"] = engine.max_sessions
    for c in levels:
        prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(c * requests_per_client)]
        level: dict[str, Any] = {"http": asyncio.run(run_http(url, model, prompts, max_tokens, c, api_key))}
        if engine is not None:
            level["direct"] = asyncio.run(run_direct(engine, prompts, max_tokens, c))
            d, h = level["direct"]["output_tok_s"], level["http"]["output_tok_s"]
            level["http_vs_direct_output_tok_s"] = round(h / d, 3) if d else None
        res["levels"][str(c)] = level
        print(f"clients {c:>3}: " + json.dumps(level), file=sys.stderr, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1))
    return res


def print_table(res: dict[str, Any]) -> None:
    print(f"{'clients':>7} {'path':<7} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'refused':>7}")
    for c, level in res["levels"].items():
        for path in ("http", "direct"):
            if path in level:
                v = level[path]
                print(f"{c:>7} {path:<7} {v['request_throughput_per_s']:>7} {v['output_tok_s']:>10} "
                      f"{v['ttft_ms_p50'] or '-':>9} {v['ttft_ms_p99'] or '-':>9} {v['itl_ms_p50'] or '-':>8} "
                      f"{v['itl_ms_p99'] or '-':>8} {v['refused']:>7}")
