"""GGUF files (llama.cpp): dequantize with the `gguf` package into HF-named tensors (and repack the quantized
ones losslessly, `gguf_repack`, for the layers that keep them packed: `quantize.pack_gguf`), and rebuild the
tokenizer. Llama-family architectures here; Qwen3.5's (``qwen35``, ``qwen35moe``) through `gguf_qwen3_5`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ModelSourceError
from . import gguf_qwen3_5, gguf_repack

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}

_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # llama.cpp stores q/k rows interleaved for its RoPE; undo it (same as transformers' GGUF loader).
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_gguf(path: Path, lazy_experts: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any],
                                                                 dict[str, Any]]:
    """Return (HF config dict, HF-named float32 state dict, tokenizer info, packed) of a Llama-family or Qwen3.5 GGUF;
    ``packed`` holds each tensor of a type that can stay quantized (`gguf_repack.SUPPORTED`), repacked
    (`gguf_repack.PackedWeight`, HF name), next to its float32 dequantization in the state dict.
    ``lazy_experts``: a Qwen3.5 MoE's routed-expert stacks that stay packed are not dequantized: their state-dict
    entries are meta tensors of their shape (the 35B model's experts are ~34B of its weights: ~136 GB as float32)."""
    try:
        import gguf
    except ImportError as e:
        raise ModelSourceError("reading GGUF files needs the gguf package: pip install gguf") from e
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises plain ValueError/struct errors on bad files
        raise ModelSourceError(f"{path} is not a readable GGUF file ({e}); check the download") from e
    arch = _field(reader, "general.architecture")
    if arch in gguf_qwen3_5.ARCHS:
        config, sd, packed = _read_qwen3_5(reader, arch, gguf, lazy_experts)
        return config, sd, _tokenizer(reader), packed
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ModelSourceError(f"GGUF architecture {arch!r} is not supported; use a llama/qwen2/qwen3/qwen35/qwen35moe "
                               "GGUF")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    n_head, n_kv = g("attention.head_count"), g("attention.head_count_kv") or g("attention.head_count")
    names = {t.name for t in reader.tensors}
    config = {
        "model_type": arch, "vocab_size": int(g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))),
        "hidden_size": g("embedding_length"), "num_hidden_layers": g("block_count"),
        "num_attention_heads": n_head, "num_key_value_heads": n_kv, "intermediate_size": g("feed_forward_length"),
        "head_dim": g("attention.key_length") or g("embedding_length") // n_head,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)), "max_position_embeddings": g("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
    }
    sd: dict[str, torch.Tensor] = {}
    packed: dict[str, gguf_repack.PackedWeight] = {}
    for t in reader.tensors:
        w, p = _read_tensor(t, gguf)
        parts = t.name.split(".")
        if parts[0] == "blk":
            kind = parts[2]
            if kind not in _LAYER_NAMES:
                raise ModelSourceError(f"GGUF tensor {t.name} is not understood; unsupported model variant")
            heads = {"attn_q": n_head, "attn_k": n_kv}.get(kind) if arch == "llama" else None
            if heads:  # rows only: the packed values, scales and mins move with them
                w = _unpermute(w, heads)
                if p is not None:
                    p = gguf_repack.PackedWeight(p.layout, p.shape, p.group, _unpermute(p.qweight, heads),
                                                 _unpermute(p.scales, heads),
                                                 None if p.mins is None else _unpermute(p.mins, heads), p.qtype)
            name = f"model.layers.{parts[1]}.{_LAYER_NAMES[kind]}.{parts[3]}"
        elif t.name in _TOP_NAMES:
            name = _TOP_NAMES[t.name]
        elif t.name == "rope_freqs.weight":
            continue
        else:
            raise ModelSourceError(f"GGUF tensor {t.name} is not understood; unsupported model variant")
        sd[name] = w
        if p is not None and w.dim() == 2:
            packed[name] = p
    if arch == "qwen2":
        config["attention_bias"] = True
    return config, sd, _tokenizer(reader), packed


def _tokenizer(reader: Any) -> dict[str, Any]:
    return {
        "model": _field(reader, "tokenizer.ggml.model"), "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": list(_field(reader, "tokenizer.ggml.tokens")),
        "token_type": list(_field(reader, "tokenizer.ggml.token_type", [])),
        "merges": list(_field(reader, "tokenizer.ggml.merges", [])),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }


_EXPERT_STACKS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def _read_qwen3_5(reader: Any, arch: str, gguf: Any, lazy_experts: bool = False) -> tuple[dict[str, Any],
                                                                                         dict[str, torch.Tensor],
                                                                                         dict[str, Any]]:
    """A Qwen3.5 GGUF as (transformers text config, float32 transformers state dict, packed): `gguf_qwen3_5`;
    ``lazy_experts``: see `read_gguf`."""
    names = {t.name for t in reader.tensors}
    config = gguf_qwen3_5.hf_config(arch, lambda k, d: _field(reader, f"{arch}.{k}", d), names,
                                    len(_field(reader, "tokenizer.ggml.tokens", [])))
    tensors = gguf_qwen3_5.Qwen35Tensors(config)
    for t in reader.tensors:
        lazy = (lazy_experts and t.name.startswith("blk.") and t.name.split(".", 2)[2] in _EXPERT_STACKS
                and t.tensor_type in gguf_repack.SUPPORTED)
        tensors.add(t.name, *_read_tensor(t, gguf, floats=not lazy))
    sd = tensors.finish()
    if any(w.is_meta and name not in tensors.packed for name, w in sd.items()):
        # a stack the packing cannot take (gate and up quantized unlike: not joined packed): floats after all
        return _read_qwen3_5(reader, arch, gguf)
    return config, sd, tensors.packed


def _read_tensor(t: Any, gguf: Any, floats: bool = True) -> tuple[torch.Tensor, gguf_repack.PackedWeight | None]:
    """A GGUF tensor as float32 in torch's shape order (GGUF's ne reversed) and, if its type can stay quantized
    (`gguf_repack.SUPPORTED`), repacked; without ``floats`` the float32 is a meta tensor (its shape, no values)."""
    shape = tuple(reversed(t.shape.tolist()))
    if floats:
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32, copy=True))
    else:
        w = torch.empty(shape, dtype=torch.float32, device="meta")
    p = gguf_repack.repack(t.tensor_type, t.data, shape) if t.tensor_type in gguf_repack.SUPPORTED else None
    return w.reshape(shape), p


def tokenizer_json_from_gguf(tok: dict[str, Any]) -> str:
    """Build a `tokenizers` JSON (byte-level BPE) from GGUF tokenizer metadata."""
    if tok["model"] != "gpt2":
        raise ModelSourceError(f"GGUF tokenizer model {tok['model']!r} is not supported; only byte-level BPE (gpt2)")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tok["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in tok["merges"]]
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if tok.get("pre") == "smollm":  # SmolLM splits digits one by one before the GPT-2 regex
        t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        t.pre_tokenizer = byte_level
    t.decoder = decoders.ByteLevel()
    control = [i for i, ty in enumerate(tok["token_type"]) if ty in (3, 4)]  # CONTROL, USER_DEFINED
    t.add_special_tokens([AddedToken(tok["tokens"][i], special=True, normalized=False) for i in control])
    return json.dumps(json.loads(t.to_str()))
