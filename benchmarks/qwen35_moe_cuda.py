"""Qwen3.5-MoE-shaped decode on CUDA: onecopy vs transformers eager on the same weights; bytes read; state per session.

Usage (on a CUDA machine, from the repository root):
    python benchmarks/qwen35_moe_cuda.py --layers 2 --out benchmarks/results/qwen35_moe_h200.json

The shape of Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults: width 2048, 256 experts
of width 512 with 8 routed per token plus a shared expert, gated DeltaNet layers with 16 key and 32
value heads of 128, gated attention with 16 query and 2 KV heads of 256, vocab 248320), with the
layer count cut to ``--layers`` (one DeltaNet layer, then one full-attention layer, alternating from
the end of each group of four as the real model does: layer i is full attention when (i+1) % 4 == 0,
and the last layer is made full attention so both kinds are measured). Random bf16 weights, the same
tensors in both runs. Batch 1, context 4096 cache: decode ms/step (onecopy graph replay; transformers
eager with its own cache), the bytes a step must read (non-expert weights but the embedding table,
the 8 routed experts of every MoE layer, the shared expert, the filled KV and the recurrent state)
and the state bytes one session holds vs a model of the same width whose layers are all full
attention, at context 4096.
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
from onecopy.bench.decode import moe_step_bytes  # noqa: E402
from onecopy.models.presets import PRESETS, random_hf_state_dict  # noqa: E402
from onecopy.models.qwen3_5_config import FULL, LINEAR, Qwen35Config  # noqa: E402
from onecopy.models.qwen3_5_convert import hf_config_from_qwen3_5  # noqa: E402
from onecopy.models.source import ModelSource, byte_tokenizer_json  # noqa: E402


def config(layers: int, tiny: bool) -> Qwen35Config:
    kinds = [FULL if (i + 1) % 4 == 0 or i == layers - 1 else LINEAR for i in range(layers)]
    if tiny:  # a dry run on CPU
        return Qwen35Config(**{**PRESETS["tiny-qwen3.5-moe"].config.to_dict(), "n_layers": layers,
                               "layer_types": kinds})
    return Qwen35Config(**{**PRESETS["qwen3.5-35b-a3b"].config.to_dict(), "n_layers": layers, "layer_types": kinds})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tiny", action="store_true", help="a tiny config on CPU (checks the script)")
    ap.add_argument("--work", default="/tmp/onecopy-bench")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev, dtype = ("cpu", torch.float32) if a.tiny else ("cuda", torch.bfloat16)
    cfg = config(a.layers, a.tiny)
    t0 = time.perf_counter()
    sd = {k: v.to(dtype) for k, v in random_hf_state_dict(cfg, seed=0).items()}
    src = ModelSource(name="qwen3.5-moe-shape", config=cfg, hf_state_dict=sd, tokenizer_json=byte_tokenizer_json(512),
                      eos_token_ids=[cfg.vocab_size - 1], family=cfg.family)
    bundle = Path(a.work) / f"qwen35-moe-{a.layers}l-{dev}"
    onecopy.export(src, bundle, max_seq_len=a.context, dtype=dtype, device=dev, overwrite=True, progress=False)
    res = {"command": "python " + " ".join(sys.argv), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "config": cfg.to_dict(),
           "export_s": round(time.perf_counter() - t0, 1), "context": a.context}
    prompt = list(range(1, 65))
    with onecopy.Engine.load(bundle, dev, max_sessions=1) as engine:
        weights = engine.weights.as_map(engine.manifest.weights)
        state = engine.manifest.state
        s = engine.open_session()
        logits = s.prefill(prompt)
        s.position = a.context - 64  # decode late in the context: the step reads a nearly full KV cache
        tok = logits.argmax(-1)
        for _ in range(5):
            tok = s.decode(tok).argmax(-1)
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        sync()
        t1 = time.perf_counter()
        for _ in range(50):
            tok = s.decode(tok).argmax(-1)
        sync()
        res["onecopy_ms_per_step"] = round(1000 * (time.perf_counter() - t1) / 50, 4)
        res["graph_buckets"] = engine.graph_buckets
        res["bytes_per_step"] = moe_step_bytes(weights, state, cfg.num_experts_per_tok, cfg.num_experts,
                                               a.context - 32)
        if dev == "cuda":  # the floor: those bytes at the copy bandwidth measured in this run
            from onecopy.bench.decode import copy_bandwidth

            bw = copy_bandwidth()
            res["copy_bandwidth_TBps"] = round(bw / 1e12, 3)
            floor_ms = 1000 * res["bytes_per_step"]["total"] / bw
            res["floor_ms"] = round(floor_ms, 4)
            res["onecopy_share_of_floor"] = round(floor_ms / res["onecopy_ms_per_step"], 3)
        per_session = sum(spec.nbytes for spec in state.values())
        kv_layer = 2 * cfg.n_kv_heads * cfg.head_dim * a.context * torch.finfo(dtype).bits // 8
        res["state_bytes_per_session"] = {"hybrid": per_session, "kv_only_same_width": cfg.n_layers * kv_layer,
                                          "note": f"{cfg.n_layers} layers at context {a.context}"}
    # transformers eager on the same tensors
    import transformers

    hf_cfg = transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in hf_config_from_qwen3_5(cfg).items()
                                                  if k != "model_type"})
    hf_cfg._attn_implementation = "eager"
    model = transformers.Qwen3_5MoeForCausalLM(hf_cfg).to(dtype).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    model = model.to(dev)
    with torch.no_grad():
        out = model(torch.tensor([prompt], device=dev), use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(40):
            sync()
            t1 = time.perf_counter()
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            sync()
            times.append(time.perf_counter() - t1)
    res["transformers_eager_ms_per_step"] = round(1000 * statistics.median(times[5:]), 3)
    res["transformers_load_notes"] = {"missing": missing[:5], "unexpected": unexpected[:5]}
    res["onecopy_speedup"] = round(res["transformers_eager_ms_per_step"] / res["onecopy_ms_per_step"], 2)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "config"}, indent=1))


if __name__ == "__main__":
    main()
