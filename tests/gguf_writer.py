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
