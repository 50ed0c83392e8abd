"""The benchmark harness itself: its peers compute the same model, the floor counts the right bytes, the plot is drawn."""

import json

import torch

import onecopy
from onecopy.bench.decode import floor_bytes, plot
from onecopy.bench.peers import CompiledPeer
from onecopy.models.llama import LlamaConfig

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
