"""Hugging Face checkpoint directories: config.json -> LlamaConfig, HF names -> onecopy names.

Also what every text family's checkpoints share: reading safetensors shards (`read_safetensors`),
checking that a mapping takes every tensor (`CheckpointTensors`), and the tokenizer, eos ids and
chat template beside the weights (`read_text_dir`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from ..errors import ModelSourceError
from . import prequantized
from .llama import LlamaConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def llama_config_from_hf(c: dict[str, Any]) -> LlamaConfig:
    """Translate a transformers config.json dict for a Llama-family model."""
    model_type = c.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelSourceError(
            f"model_type {model_type!r} is not supported; onecopy exports {', '.join(SUPPORTED_MODEL_TYPES)}")
    if c.get("use_sliding_window") or (model_type == "mistral" and c.get("sliding_window")):
        raise ModelSourceError("sliding-window attention is not supported; use a checkpoint without it")
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = c.get("rope_theta") or rope.get("rope_theta") or 10000.0
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = {}
    return LlamaConfig(
        vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
        n_heads=c["num_attention_heads"], n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        intermediate_size=c["intermediate_size"], head_dim=c.get("head_dim") or 0,
        rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=rope or None,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(c.get("attention_bias", False)),
        qk_norm=model_type == "qwen3", max_position_embeddings=c.get("max_position_embeddings", 2048))


def hf_config_from_llama(cfg: LlamaConfig) -> dict[str, Any]:
    """The transformers config.json of a LlamaConfig (plain Llama only: used for references and presets)."""
    d = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "intermediate_size": cfg.intermediate_size,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.qkv_bias,
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
    }
    if cfg.rope_scaling:
        d["rope_scaling"] = cfg.rope_scaling
    return d


class CheckpointTensors:
    """A checkpoint's tensors taken by name while mapping them; `check_all_taken` then refuses a
    checkpoint with tensors the mapping never took (a different architecture or layer count)."""

    def __init__(self, sd: dict[str, torch.Tensor], expected: str) -> None:
        self.sd, self.expected = sd, expected
        self.used: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.sd

    def take(self, name: str) -> torch.Tensor:
        if name not in self.sd:
            raise ModelSourceError(f"checkpoint lacks tensor {name!r}; is this a {self.expected}?")
        self.used.add(name)
        return self.sd[name]

    def ignore(self, name: str) -> None:
        """A tensor that may be present and needs no mapping (e.g. a tied LM head's alias)."""
        self.used.add(name)

    def check_all_taken(self) -> None:
        extra = sorted(set(self.sd) - self.used)
        if extra:
            raise ModelSourceError(f"checkpoint has tensors onecopy does not map: {extra[:5]}"
                                   f"{'...' if len(extra) > 5 else ''}")


def hf_to_onecopy(sd: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Rename HF weights to onecopy FQNs, fusing q/k/v into wqkv and gate/up into w13."""
    ckpt = CheckpointTensors({k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")},
                             f"{cfg.n_layers}-layer Llama-family model")
    take = ckpt.take
    out = {"tok_embeddings.weight": take("model.embed_tokens.weight")}
    for i in range(cfg.n_layers):
        p, a = f"model.layers.{i}.", f"layers.{i}."
        out[a + "attention.wqkv.weight"] = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        if cfg.qkv_bias:
            out[a + "attention.wqkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        if cfg.qk_norm:
            out[a + "attention.q_norm.weight"] = take(p + "self_attn.q_norm.weight")
            out[a + "attention.k_norm.weight"] = take(p + "self_attn.k_norm.weight")
        out[a + "attention.wo.weight"] = take(p + "self_attn.o_proj.weight")
        out[a + "feed_forward.w13.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        out[a + "feed_forward.w2.weight"] = take(p + "mlp.down_proj.weight")
        out[a + "attention_norm.weight"] = take(p + "input_layernorm.weight")
        out[a + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
    out["norm.weight"] = take("model.norm.weight")
    if not cfg.tie_embeddings:
        out["output.weight"] = take("lm_head.weight")
    else:
        ckpt.ignore("lm_head.weight")  # tied checkpoints sometimes store the alias too
    ckpt.check_all_taken()
    return out


def onecopy_to_hf(sd: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_onecopy`: split wqkv and w13 back into transformers' names (views, no copy)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    for i in range(cfg.n_layers):
        p, a = f"model.layers.{i}.", f"layers.{i}."
        for suffix in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            for n, part in zip("qkv", sd[a + f"attention.wqkv.{suffix}"].split([q, kv, kv])):
                out[p + f"self_attn.{n}_proj.{suffix}"] = part
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = sd[a + "attention.q_norm.weight"]
            out[p + "self_attn.k_norm.weight"] = sd[a + "attention.k_norm.weight"]
        out[p + "self_attn.o_proj.weight"] = sd[a + "attention.wo.weight"]
        gate, up = sd[a + "feed_forward.w13.weight"].split(cfg.intermediate_size)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = sd[a + "feed_forward.w2.weight"]
        out[p + "input_layernorm.weight"] = sd[a + "attention_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = sd[a + "ffn_norm.weight"]
    out["lm_head.weight"] = sd["tok_embeddings.weight"] if cfg.tie_embeddings else sd["output.weight"]
    return out


def read_hf_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read config.json and every safetensors shard (sharded via model.safetensors.index.json or not)."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelSourceError(f"{path} has no config.json; point at a Hugging Face checkpoint directory")
    config = json.loads(cfg_file.read_text())
    llama_config_from_hf(config)  # refuse unsupported models before reading gigabytes of weights
    return config, read_safetensors(path)


def read_safetensors(path: Path, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint dir's safetensors shards (indexed or not), names starting with ``skip`` left out."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(f"{path} has no *.safetensors weights; convert .bin checkpoints to safetensors first")
    cfg_file = path / "config.json"
    quant = (json.loads(cfg_file.read_text()).get("quantization_config") or {}) if cfg_file.is_file() else {}
    block = tuple(quant.get("weight_block_size") or (128, 128))
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        if not (path / f).is_file():
            raise ModelSourceError(f"shard {f} named in the index is missing from {path}")
        with safe_open(str(path / f), framework="pt") as st:
            for k in st.keys():
                if not (skip and k.startswith(skip)):
                    sd[k] = st.get_tensor(k)
                    if k.endswith("_scale_inv"):  # an FP8 block-scaled pair is complete: dequantize it at once
                        _fp8_blocks(sd, k, block)
    for k in [k for k, v in sd.items() if v.dtype == torch.float8_e4m3fn]:
        _fp8_blocks(sd, k + "_scale_inv", block)
    return sd


def _fp8_blocks(sd: dict[str, torch.Tensor], scale_name: str, block: tuple[int, ...]) -> None:
    """An FP8 checkpoint's weight (the format of Qwen's and DeepSeek's FP8 releases: ``quantization_config``
    ``quant_method: fp8``, float8 e4m3 ``X.weight`` with a float32 ``X.weight_scale_inv`` per block of
    ``weight_block_size`` rows x columns, w = q * s) dequantized to bfloat16 in place, once both are read (shards
    may hold them apart). A weight without its scales is refused: its values alone are not the weights."""
    name = scale_name[:-len("_scale_inv")]
    q, s = sd.get(name), sd.get(scale_name)
    if q is None or s is None:
        if q is not None:
            raise ModelSourceError(f"{name} is float8 without its {scale_name}; onecopy reads FP8 checkpoints with "
                                   "block scales (quant_method fp8, weight_block_size)")
        return
    n, k = q.shape[-2:]
    bn, bk = block
    if s.shape[-2:] != (-(-n // bn), -(-k // bk)):
        raise ModelSourceError(f"{scale_name} is {list(s.shape)}, not one scale per {bn} x {bk} block of {name} "
                               f"{list(q.shape)}; check quantization_config.weight_block_size")
    scale = s.float().repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    sd[name] = (q.float() * scale).to(torch.bfloat16)
    del sd[scale_name]


def read_text_dir(path: Path, read_checkpoint: Callable[[Path], tuple[dict[str, Any], dict[str, torch.Tensor]]],
                  config_from_hf: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """A text model's checkpoint directory as `source.ModelSource` fields: ``read_checkpoint`` gives
    config.json and the weights, ``config_from_hf`` the family's config; tokenizer.json, the eos ids
    (generation_config.json's over config.json's) and the chat template come from beside them. A GPTQ or AWQ
    checkpoint's linears come packed too (`prequantized`), as a GGUF's quantized tensors do."""
    config, sd = read_checkpoint(path)
    packed = prequantized.read_packed(sd, prequantized.quantization_config(path))  # GPTQ / AWQ: float32 in sd too
    # a multimodal checkpoint's text model is model.language_model.*, as the family's renaming takes it
    packed = {k.replace("model.language_model.", "model.", 1): v for k, v in packed.items()}
    cfg = config_from_hf(config)
    if packed and getattr(cfg, "num_experts", 0):
        packed = prequantized.stack_experts(packed, cfg.num_experts)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelSourceError(f"{path} has no tokenizer.json; save the fast tokenizer next to the weights")
    eos = config.get("eos_token_id")
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
    chat_template = None
    tok_cfg = path / "tokenizer_config.json"
    if tok_cfg.is_file():
        chat_template = json.loads(tok_cfg.read_text()).get("chat_template")
    if (path / "chat_template.jinja").is_file():
        chat_template = (path / "chat_template.jinja").read_text()
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return dict(config=cfg, hf_state_dict=sd, tokenizer_json=tok_file.read_text(), eos_token_ids=eos_ids,
                bos_token_id=config.get("bos_token_id"), chat_template=chat_template, packed=packed)
