"""Qwen3.5 checkpoints: transformers' config.json and tensor names to `qwen3_5.Qwen35` and back.

Reads the text model of both the ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` checkpoints and
the multimodal ones Qwen ships (text config nested under ``text_config``, tensors under
``model.language_model.*``; the vision tower and the MTP head are skipped), fusing projections into
onecopy's layout. `hf_config_from_qwen3_5` writes the config.json that `ModelSource.save_hf` saves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelSourceError
from .hf_checkpoint import CheckpointTensors, read_safetensors
from .qwen3_5_config import FULL, LINEAR, Qwen35Config

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def text_config(c: dict[str, Any]) -> dict[str, Any]:
    """The text part of a config.json (``qwen3_5``/``qwen3_5_moe`` nest it under ``text_config``)."""
    if c.get("model_type") in ("qwen3_5", "qwen3_5_moe") and isinstance(c.get("text_config"), dict):
        t = dict(c["text_config"])
        t.setdefault("model_type", c["model_type"] + "_text")
        for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
            if key in c and key not in t:
                t[key] = c[key]
        return t
    return c


def config_from_hf(c: dict[str, Any]) -> Qwen35Config:
    """Translate a transformers config.json dict (ForCausalLM text config or the multimodal one)."""
    c = text_config(c)
    model_type = c.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ModelSourceError(f"model_type {model_type!r} is not a Qwen3.5 model ({', '.join(MODEL_TYPES)})")
    if c.get("hidden_act", "silu") != "silu":
        raise ModelSourceError(f"hidden_act {c['hidden_act']!r} is not supported; Qwen3.5 uses silu")
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = rope.get("rope_theta") or c.get("rope_theta") or 10000.0
    prf = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if kind != "default":
        scaling = {k: v for k, v in rope.items()
                   if k not in ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")}
    n_layers = c["num_hidden_layers"]
    layer_types = c.get("layer_types") or [
        LINEAR if (i + 1) % c.get("full_attention_interval", 4) else FULL for i in range(n_layers)]
    moe = model_type.startswith("qwen3_5_moe")
    n_heads = c["num_attention_heads"]
    try:
        return Qwen35Config(
            vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=c.get("num_key_value_heads") or n_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
            intermediate_size=0 if moe else c["intermediate_size"], layer_types=list(layer_types),
            linear_conv_kernel=c.get("linear_conv_kernel_dim", 4), linear_n_k_heads=c.get("linear_num_key_heads", 16),
            linear_n_v_heads=c.get("linear_num_value_heads", 32), linear_k_head_dim=c.get("linear_key_head_dim", 128),
            linear_v_head_dim=c.get("linear_value_head_dim", 128), rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), partial_rotary_factor=float(prf), rope_scaling=scaling,
            tie_embeddings=bool(c.get("tie_word_embeddings", False)), attention_bias=bool(c.get("attention_bias", False)),
            max_position_embeddings=c.get("max_position_embeddings", 32768),
            num_experts=c.get("num_experts", 0) if moe else 0,
            num_experts_per_tok=c.get("num_experts_per_tok", 0) if moe else 0,
            moe_intermediate_size=c.get("moe_intermediate_size", 0) if moe else 0,
            shared_expert_intermediate_size=c.get("shared_expert_intermediate_size", 0) if moe else 0)
    except (KeyError, ValueError) as e:
        raise ModelSourceError(f"config.json does not describe a Qwen3.5 text model: {e}") from e


def hf_config_from_qwen3_5(cfg: Qwen35Config) -> dict[str, Any]:
    """The transformers config.json of the text model (``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor}
    if cfg.rope_scaling:
        rope.update(cfg.rope_scaling)
    d: dict[str, Any] = {
        "architectures": ["Qwen3_5MoeForCausalLM" if cfg.moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if cfg.moe else "qwen3_5_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attention_bias,
        "layer_types": list(cfg.layer_types), "linear_conv_kernel_dim": cfg.linear_conv_kernel,
        "linear_key_head_dim": cfg.linear_k_head_dim, "linear_value_head_dim": cfg.linear_v_head_dim,
        "linear_num_key_heads": cfg.linear_n_k_heads, "linear_num_value_heads": cfg.linear_n_v_heads,
        "rope_parameters": rope,
    }
    if cfg.moe:
        d.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                 moe_intermediate_size=cfg.moe_intermediate_size,
                 shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    else:
        d["intermediate_size"] = cfg.intermediate_size
    return d


def hf_to_onecopy(sd: dict[str, torch.Tensor], cfg: Qwen35Config) -> dict[str, torch.Tensor]:
    """HF names (``model.*`` of the ForCausalLM, or ``model.language_model.*`` of the multimodal
    checkpoints, whose vision tower and MTP head are skipped) to onecopy FQNs, fusing projections.
    MoE experts may be stored fused (``experts.gate_up_proj``) or per expert (``experts.N.gate_proj``)."""
    norm: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.startswith(("model.visual.", "mtp.")) or k.endswith("rotary_emb.inv_freq"):
            continue
        norm[k.replace("model.language_model.", "model.", 1)] = v
    ckpt = CheckpointTensors(norm, f"{cfg.n_layers}-layer Qwen3.5 ({cfg.family}) text model")
    take = ckpt.take

    def mlp(p: str, a: str) -> dict[str, torch.Tensor]:
        return {a + "w13.weight": torch.cat([take(p + "gate_proj.weight"), take(p + "up_proj.weight")]),
                a + "w2.weight": take(p + "down_proj.weight")}

    out = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    for i, kind in enumerate(cfg.layer_types):
        p, a = f"model.layers.{i}.", f"layers.{i}."
        out[a + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        out[a + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        if kind == LINEAR:
            la, oa = p + "linear_attn.", a + "linear_attn."
            out[oa + "in_proj.weight"] = torch.cat([take(la + f"in_proj_{n}.weight") for n in ("qkv", "z", "b", "a")])
            out[oa + "conv1d.weight"] = take(la + "conv1d.weight")
            for n in ("dt_bias", "A_log", "norm.weight", "out_proj.weight"):
                out[oa + n] = take(la + n)
        else:
            sa, oa = p + "self_attn.", a + "self_attn."
            out[oa + "wqkv.weight"] = torch.cat([take(sa + f"{n}_proj.weight") for n in "qkv"])
            if cfg.attention_bias:
                out[oa + "wqkv.bias"] = torch.cat([take(sa + f"{n}_proj.bias") for n in "qkv"])
                out[oa + "wo.bias"] = take(sa + "o_proj.bias")
            out[oa + "wo.weight"] = take(sa + "o_proj.weight")
            out[oa + "q_norm.weight"] = take(sa + "q_norm.weight")
            out[oa + "k_norm.weight"] = take(sa + "k_norm.weight")
        m, om = p + "mlp.", a + "mlp."
        if not cfg.moe:
            out.update(mlp(m, om))
            continue
        out[om + "gate.weight"] = take(m + "gate.weight")
        if m + "experts.gate_up_proj" in ckpt:
            out[om + "experts.gate_up_proj"] = take(m + "experts.gate_up_proj")
            out[om + "experts.down_proj"] = take(m + "experts.down_proj")
        else:
            e = range(cfg.num_experts)
            gate = torch.stack([take(m + f"experts.{j}.gate_proj.weight") for j in e])
            up = torch.stack([take(m + f"experts.{j}.up_proj.weight") for j in e])
            out[om + "experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
            out[om + "experts.down_proj"] = torch.stack([take(m + f"experts.{j}.down_proj.weight") for j in e])
        out.update(mlp(m + "shared_expert.", om + "shared_expert."))
        out[om + "shared_expert_gate.weight"] = take(m + "shared_expert_gate.weight")
    if cfg.tie_embeddings:
        ckpt.ignore("lm_head.weight")  # tied checkpoints sometimes store the alias too
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    ckpt.check_all_taken()
    return out


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json (its text part) and every safetensors shard (indexed or not), vision/MTP tensors skipped."""
    config = text_config(json.loads((path / "config.json").read_text()))
    config_from_hf(config)  # refuse what this is not before reading weights
    return config, read_safetensors(path, skip=("model.visual.", "mtp."))
