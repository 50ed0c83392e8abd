"""A tiny Llama GGUF written by the `gguf` package, with every type that stays packed among its tensors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

DIM, HIDDEN, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 512, 2
# Per layer: (q, k, v, o, gate, up, down). Layer 0's q/k/v differ in type: its wqkv stays float.
LAYER_TYPES = [(Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q5_K, Q.Q4_0, Q.Q4_0, Q.Q6_K),
               (Q.Q8_0, Q.Q8_0, Q.Q8_0, Q.Q4_1, Q.Q4_K, Q.Q4_K, Q.Q5_K)]
HEAD_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of the fp16 d (and dmin)


def quantized(qtype: Q, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of ``qtype`` blocks of modest values: gguf quantizes the simple types; K-quant
    blocks get random bytes with small fp16 scales (gguf-py cannot quantize those)."""
    if qtype not in HEAD_FIELDS:
        return gguf.quants.quantize(rng.standard_normal((rows, k)).astype(np.float32) * 0.05, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * k // block, size), dtype=np.uint8)
    for off in HEAD_FIELDS[qtype]:
        raw[:, off:off + 2] = rng.uniform(2e-5, 2e-4, raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """Write the model (byte-level BPE vocabulary, untied Q6_K output, Q8_0 embedding) and return ``path``."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(DIM)
    w.add_feed_forward_length(HIDDEN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    import tokenizers

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + [f"<x{i}>" for i in range(len(alphabet), VOCAB - 1)] + ["<|endoftext|>"]
    w.add_token_list(tokens)
    w.add_token_types([1] * (VOCAB - 1) + [3])
    w.add_token_merges([])
    w.add_bos_token_id(VOCAB - 1)
    w.add_eos_token_id(VOCAB - 1)
    q, kv = HEADS * (DIM // HEADS), KV_HEADS * (DIM // HEADS)
    shapes = {"attn_q": (q, DIM), "attn_k": (kv, DIM), "attn_v": (kv, DIM), "attn_output": (DIM, q),
              "ffn_gate": (HIDDEN, DIM), "ffn_up": (HIDDEN, DIM), "ffn_down": (DIM, HIDDEN)}

    def add(name: str, qtype: Q, rows: int, k: int) -> None:
        w.add_tensor(name, quantized(qtype, rows, k, rng), raw_dtype=qtype)

    add("token_embd.weight", Q.Q8_0, VOCAB, DIM)
    for i, types in enumerate(LAYER_TYPES):
        for (kind, (rows, k)), qtype in zip(shapes.items(), types):
            add(f"blk.{i}.{kind}.weight", qtype, rows, k)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(DIM, np.float32))
    add("output.weight", Q.Q6_K, VOCAB, DIM)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------------- Qwen3.5
# A mirror of llama.cpp's converter for Qwen3.5 (conversion/qwen.py at 0c1e5709: Qwen3_5(Moe)TextModel over
# _LinearAttentionVReorderBase, Qwen3NextModel and Qwen2MoeModel; base.py's dtype rules), checked against the real
# converter and llama.cpp's runtime on a random model (onecopy/models/gguf_qwen3_5.py says what it undoes).

_Q35_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def _reorder_v_heads(t: np.ndarray, dim: int, num_k_heads: int, num_v_per_k: int, head_dim: int) -> np.ndarray:
    """llama.cpp's _LinearAttentionVReorderBase._reorder_v_heads (grouped value heads to tiled)."""
    shape = list(t.shape)
    t = t.reshape(shape[:dim] + [num_k_heads, num_v_per_k, head_dim] + shape[dim + 1:])
    return np.ascontiguousarray(np.swapaxes(t, dim, dim + 1)).reshape(shape)


def qwen35_gguf_tensors(sd: dict, cfg) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for a Qwen3.5 transformers state dict, as llama.cpp's converter writes them."""
    nk, nv, dk, dv = cfg.linear_n_k_heads, cfg.linear_n_v_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim
    r, key_dim = nv // nk, nk * dk
    out = []
    for name, t in sd.items():
        x = t.float().numpy()
        if nk != nv and "linear_attn." in name:  # the value heads, grouped -> tiled
            if name.endswith("in_proj_qkv.weight"):
                x = np.concatenate([x[:2 * key_dim], _reorder_v_heads(x[2 * key_dim:], 0, nk, r, dv)])
            elif name.endswith("in_proj_z.weight"):
                x = _reorder_v_heads(x, 0, nk, r, dv)
            elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
                x = _reorder_v_heads(x, 0, nk, r, 1)
            elif name.endswith("conv1d.weight"):
                x = x.squeeze()
                x = np.concatenate([x[:2 * key_dim], _reorder_v_heads(x[2 * key_dim:], 0, nk, r, dv)])
            elif name.endswith("out_proj.weight"):
                x = _reorder_v_heads(x, 1, nk, r, dv)
        if name.endswith("A_log"):
            x = -np.exp(x)
        elif "conv1d" in name:
            x = x.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + 1
        if name.endswith("mlp.experts.gate_up_proj"):
            i, f = name.split(".")[2], x.shape[1] // 2
            out += [(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(x[:, :f])),
                    (f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(x[:, f:]))]
        elif name.endswith("mlp.experts.down_proj"):
            out.append((f"blk.{name.split('.')[2]}.ffn_down_exps.weight", x))
        elif name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out.append(({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name], x))
        else:
            _, _, i, rest = name.split(".", 3)
            out.append((f"blk.{i}.{_Q35_BLOCK[rest]}", x))
    return out


def write_qwen35_gguf(path: Path, src, qtype: Q = Q.F32, mtp: bool = False, extra: tuple = ()) -> Path:
    """A tiny Qwen3.5 (``qwen35``) or Qwen3.5-MoE (``qwen35moe``) GGUF of a `ModelSource`'s weights, metadata as
    llama.cpp's converter writes it; 2-D weights in ``qtype`` (F32 or one gguf quantizes), the norms, conv, routers
    and 1-D tensors in F32 as the converter keeps them; ``mtp``: a multi-token-prediction block after the layers;
    ``extra``: more (name, array) tensors."""
    cfg = src.config
    arch = "qwen35moe" if cfg.moe else "qwen35"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers + (1 if mtp else 0))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if cfg.moe:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel)
    w.add_ssm_state_size(cfg.linear_k_head_dim)
    w.add_ssm_group_count(cfg.linear_n_k_heads)
    w.add_ssm_time_step_rank(cfg.linear_n_v_heads)
    w.add_ssm_inner_size(cfg.linear_v_head_dim * cfg.linear_n_v_heads)
    w.add_full_attention_interval(4)
    w.add_array(f"{arch}.attention.recurrent_layers",
                [t == "linear_attention" for t in cfg.layer_types] + [False] * (1 if mtp else 0))
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.partial_rotary_factor))
    if mtp:
        w.add_nextn_predict_layers(1)
    import tokenizers

    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    vocab = cfg.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(alphabet + [f"<x{i}>" for i in range(len(alphabet), vocab - 1)] + ["<|endoftext|>"])
    w.add_token_types([1] * (vocab - 1) + [3])
    w.add_token_merges([])
    w.add_eos_token_id(vocab - 1)
    tensors = qwen35_gguf_tensors(src.hf_state_dict, cfg)
    if mtp:  # the shapes of a real MTP block's first tensors; onecopy skips them
        rng = np.random.default_rng(0)
        tensors += [(f"blk.{cfg.n_layers}.nextn.eh_proj.weight", rng.standard_normal((cfg.dim, 2 * cfg.dim), np.float32)),
                    (f"blk.{cfg.n_layers}.attn_norm.weight", np.ones(cfg.dim, np.float32))]
    for name, x in [*tensors, *extra]:
        float_kept = (x.ndim <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp" in name or "ssm_conv1d" in name
                      or not name.endswith(".weight"))
        if qtype == Q.F32 or float_kept:
            w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
