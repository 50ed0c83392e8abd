"""The benchmark harness itself: its peers compute the same model, the floor counts the right bytes, the plot is drawn."""

import json

import pytest
import torch

import onecopy
from onecopy.bench.decode import floor_bytes, plot
from onecopy.bench.peers import CompiledPeer
from onecopy.models.llama import LlamaConfig

from .conftest import run_cli

PROMPT = [7, 3, 99, 250, 18]


def test_compiled_peer_is_the_same_model(tiny_engine):
    """The gpt-fast-style peer, run on views of the engine's weights (uncompiled here), greedy-decodes
    exactly what onecopy does: the peers compare speed, not different models."""
    want = tiny_engine.submit(PROMPT, onecopy.SamplingParams(max_new_tokens=12), stop_ids=[]).result()
    cfg = LlamaConfig.from_dict(tiny_engine.manifest.config)
    weights = {f: tiny_engine.weights.get(f) for f in tiny_engine.manifest.weights}
    peer = CompiledPeer(weights, cfg, tiny_engine.max_seq_len)
    with torch.no_grad():
        logits = peer.forward(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
        got, pos = [], len(PROMPT)
        for _ in range(12):
            got.append(int(logits.argmax(-1)))
            logits = peer.forward(torch.tensor([[got[-1]]]), torch.tensor([pos]))
            pos += 1
    assert got == want
    # Weights and caches are static addresses for torch.compile: a mutated cache that is a plain graph
    # input makes reduce-overhead skip its CUDA graphs (seen on the H200: 7.3 instead of 5.5 ms/token).
    for t in (*weights.values(), *peer.k, *peer.v):
        assert getattr(t, "_dynamo_static_input_type", None) is not None


def test_the_floor_leaves_out_the_gathered_embedding_table():
    cfg = LlamaConfig(vocab_size=1000, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=16)
    w = {"tok_embeddings.weight": torch.zeros(1000, 8, dtype=torch.bfloat16), "norm.weight": torch.zeros(8, dtype=torch.bfloat16),
         "output.weight": torch.zeros(1000, 8, dtype=torch.bfloat16)}
    weights, kv = floor_bytes(w, cfg, context=100)
    assert weights == 2 * (8 + 8000)  # norm + LM head; the embedding table is gathered, not read
    assert kv == 2 * 2 * 1 * 4 * 2 * 100  # layers x (K, V) x kv_heads x head_dim x bf16 x positions
    # an 8-bit cache: head_dim bytes and a float32 scale per position and head
    assert floor_bytes(w, cfg, context=100, kv_8bit=True)[1] == 2 * 2 * 1 * (4 + 4) * 100
    tied = LlamaConfig(vocab_size=1000, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, intermediate_size=16,
                       tie_embeddings=True)
    w.pop("output.weight")
    assert floor_bytes(w, tied, context=0)[0] == 2 * (8 + 8000)  # tied: the table is the LM head, read once


def test_plot_is_written(tmp_path):
    rows = [{"system": s, "prompt_len": n, "tok_s": t, "ttft_ms": 10.0 * n / 128}
            for s, t in (("onecopy", 200.0), ("torch.compile", 180.0)) for n in (128, 1024)]
    plot({"rows": rows, "source": "llama3-8b", "device": "test", "max_seq_len": 2048}, tmp_path / "p.png")
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    json.dumps(rows)


def test_bench_throughput_runs_every_point_with_all_requests_at_once(tiny_bundle, tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    r = run_cli("bench", "throughput", "--bundle", str(tiny_bundle), "--points", "8/4,16/8", "--requests", "12",
                "--max-sessions", "4", "--token-budget", "64", "--prefill", "both", "--out", str(out), "--png", str(png))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    # each point twice: one prefill call per prompt chunk, then equal-length chunks batched (prompts of 8 or 16: one
    # chunk each), each run with its own prompts
    assert [(p["input_len"], p["output_len"], p["prefill"]) for p in res["points"]] == \
        [(8, 4, "per-chunk"), (8, 4, "batched"), (16, 8, "per-chunk"), (16, 8, "batched")]
    assert [p["output_tokens"] for p in res["points"]] == [12 * 4] * 2 + [12 * 8] * 2  # to its length, no stop id
    for p in res["points"]:
        calls = {phase: t["calls"] for phase, t in p["device_time"].items()}
        assert set(calls) == {"prefill", "decode", "sample"} and all(t["seconds"] >= 0 for t in p["device_time"].values())
        assert calls["prefill"] == 12 if p["prefill"] == "per-chunk" else calls["prefill"] < 12
    for p in res["points"]:
        assert p["output_tok_s"] > 0 and p["ttft_ms"]["p50"] <= p["ttft_ms"]["p99"] and p["itl_ms"]["p50"] > 0
        assert 1 < p["mean_decode_batch"] <= 4 and p["rows"] == p["rows_used_max"] == 4  # rows taken as they freed
        assert 0 < p["kv_blocks_used_max"] <= p["kv_blocks"] and p["preemptions"] == 0  # every row fits: no preemption
        assert p["trtllm_tok_s"] is None and p["vs_trtllm"] is None  # TensorRT-LLM's table is for H100/H200 runs
    assert res["reference"] is None and png.stat().st_size > 0 and "8/4" in r.stdout
    assert res["requests"] == 12 and [p["requests"] for p in res["points"]] == [12] * 4
    r = run_cli("bench", "throughput", "--bundle", str(tiny_bundle), "--points", "8x4")
    assert r.returncode == 2 and "--points entry '8x4' is not INPUT/OUTPUT token counts" in r.stderr
    r = run_cli("bench", "throughput", "--bundle", str(tiny_bundle), "--requests", "0")
    assert r.returncode == 2 and "--requests must be >= 1, got 0" in r.stderr
    r = run_cli("bench", "throughput", "--bundle", str(tiny_bundle), "--points", "60/60", "--requests", "1")
    assert r.returncode == 2 and "point 60/60 needs 120 positions and the bundle holds" in r.stderr
    r = run_cli("bench", "throughput", "--bundle", str(tiny_bundle), "--prefill", "sometimes")
    assert r.returncode == 2 and "argument --prefill: invalid choice: 'sometimes'" in r.stderr


def test_bench_throughput_runs_tensorrt_llms_request_count_at_each_of_its_points():
    """A run of one wave of requests measures its ramp and drain; TensorRT-LLM ran 30000 requests at 128/128, 3000
    at 1000/1000 and 1500 at 2048/2048 to reach a steady state, and the comparison runs as many unless told."""
    from onecopy.bench.throughput import DEFAULT_POINTS, parse_points, point_requests

    assert [point_requests(p, None) for p in parse_points(DEFAULT_POINTS)] == [30000, 3000, 1500]
    assert point_requests((7, 9), None) == 1024 and point_requests((128, 128), 12) == 12
    assert point_requests((128, 128), None, cuda=False) == 32 and point_requests((128, 128), 5, cuda=False) == 5


def test_bench_throughput_refuses_an_unknown_prefill_mode_by_name(tiny_engine):
    from onecopy.bench.throughput import bench_throughput

    with pytest.raises(onecopy.InputError, match=r"prefill must be one of batched, per-chunk, both, got 'sometimes'"):
        bench_throughput(tiny_engine, [(8, 4)], 1, command="test", prefill="sometimes")
    assert tiny_engine.runner.batched_prefill  # refused before any run: the engine is as it was


def test_trtllm_figures_are_matched_to_the_gpu_by_name():
    from onecopy.bench.throughput import reference_gpu

    assert reference_gpu("NVIDIA H100 80GB HBM3") == "H100" and reference_gpu("NVIDIA H200") == "H200"
    assert reference_gpu("NVIDIA A100-SXM4-80GB") is None


def test_an_int4_bench_runs_the_tinygemm_peer_and_it_needs_int4_values():
    """`onecopy bench --quantize int4` adds the tinygemm peer (torch's int4 GEMM on the bundle's own values);
    asked of a bundle without 4-bit projections it says which export it needs."""
    from onecopy.bench.decode import PEERS, default_peers, int4_layers

    assert default_peers("int4").split(",") == ["torch.compile", "transformers", "tinygemm"]
    assert default_peers("int8") == default_peers(None) == "torch.compile,transformers"
    assert set(default_peers("int4").split(",")) <= set(PEERS)
    q = {"layers.0.attention.wo": {"layout": "q8s_mma", "group": 128}, "tok_embeddings": {"layout": "q4a", "group": 32}}
    with pytest.raises(ValueError, match="export with --quantize int4"):
        int4_layers({}, q)
