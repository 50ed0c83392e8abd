"""The presets: models named by a string, with seeded random weights in real models' shapes (tests,
benchmarks). `source.preset_source` turns one into a `source.ModelSource`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .families import family
from .llama import LlamaConfig
from .qwen3_5_config import FULL, LINEAR, Qwen35Config


@dataclass
class Preset:
    config: LlamaConfig | Qwen35Config
    description: str
    on_device: bool = False  # weights drawn at build time on the export device, in its dtype (large shapes)


PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset(
        LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                    max_position_embeddings=256, rope_theta=10000.0),
        "seeded random 2-layer Llama for tests"),
    "llama-8l-2048": Preset(
        LlamaConfig(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, intermediate_size=5632,
                    max_position_embeddings=4096, rope_theta=500000.0),
        "seeded random 8-layer, 2048-wide Llama for benchmarks"),
    "llama3-8b": Preset(
        LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                    rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0),
        "Llama-3-8B shape, seeded random weights drawn on the export device", on_device=True),
    "llama3-8b-8l": Preset(
        LlamaConfig(vocab_size=128256, dim=4096, n_layers=8, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                    rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0),
        "8 layers of the Llama-3-8B shape (quick benchmarks), random weights drawn on the device", on_device=True),
    "llama3-1b": Preset(
        LlamaConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, intermediate_size=8192,
                    head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0,
                    tie_embeddings=True),
        "Llama-3.2-1B shape, seeded random weights drawn on the export device", on_device=True),
    "tiny-qwen3.5": Preset(
        Qwen35Config(
            vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, intermediate_size=128,
            layer_types=[LINEAR, LINEAR, FULL, LINEAR], linear_conv_kernel=4, linear_n_k_heads=2, linear_n_v_heads=4,
            linear_k_head_dim=16, linear_v_head_dim=16, rope_theta=10000.0, max_position_embeddings=256,
            linear_chunk_size=32),
        "seeded random 4-layer Qwen3.5 (three DeltaNet layers, one attention) for tests"),
    "tiny-qwen3.5-moe": Preset(
        Qwen35Config(
            vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, intermediate_size=0,
            layer_types=[LINEAR, FULL, LINEAR, FULL], linear_conv_kernel=4, linear_n_k_heads=2, linear_n_v_heads=4,
            linear_k_head_dim=16, linear_v_head_dim=16, rope_theta=10000.0, max_position_embeddings=256,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            linear_chunk_size=32),
        "seeded random 4-layer Qwen3.5 MoE (4 experts, 2 per token, a shared expert) for tests"),
    # transformers' Qwen3_5MoeTextConfig defaults: 40 layers (DeltaNet, DeltaNet, DeltaNet, attention; x 10), width
    # 2048, 256 experts of width 512 (8 routed a token) and a shared expert, DeltaNet 16 key / 32 value heads of
    # 128, gated attention 16 query / 2 KV heads of 256 (a quarter rotary), vocab 248320: ~35B weights, ~3B a token
    "qwen3.5-35b-a3b": Preset(
        Qwen35Config(
            vocab_size=248320, dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, head_dim=256, intermediate_size=0,
            layer_types=[FULL if (i + 1) % 4 == 0 else LINEAR for i in range(40)], linear_conv_kernel=4,
            linear_n_k_heads=16, linear_n_v_heads=32, linear_k_head_dim=128, linear_v_head_dim=128,
            rope_theta=10_000_000.0, partial_rotary_factor=0.25, max_position_embeddings=262144,
            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512),
        "Qwen3.5-35B-A3B shape (the whole 40 layers), seeded random weights drawn on the export device",
        on_device=True),
}


def random_hf_state_dict(cfg: LlamaConfig | Qwen35Config, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights for ``cfg`` under transformers' names, drawn as its family's presets draw them
    (`random_weights`): the same config and seed give the same tensors, bit for bit."""
    draw = family(cfg.family).random_weights
    if draw is None:
        raise ValueError(f"the {cfg.family} family has no random weights")
    return draw(cfg, seed)
