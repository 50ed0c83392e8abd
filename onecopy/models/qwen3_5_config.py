"""The Qwen3.5 text config (`Qwen35Config`) and its layer kinds (``LINEAR``: gated DeltaNet, ``FULL``: gated
full attention): what the model (`qwen3_5`), its DeltaNet mixer (`qwen3_5_deltanet`), the checkpoint
conversion (`qwen3_5_convert`) and the presets read. A module of its own so that the model and the mixer
both import it rather than each other.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class Qwen35Config:
    """Shape and numerics of a Qwen3.5 text model (MoE when ``num_experts`` > 0)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (unused by MoE models)
    layer_types: list[str] = field(default_factory=list)  # empty: every 4th layer full attention
    linear_conv_kernel: int = 4
    linear_n_k_heads: int = 16
    linear_n_v_heads: int = 32
    linear_k_head_dim: int = 128
    linear_v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    rope_scaling: dict[str, Any] | None = None  # non-default rope types, transformers' parameters
    tie_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    linear_chunk_size: int = 64  # target tokens per DeltaNet prefill chunk (onecopy, not transformers)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [LINEAR if (i + 1) % 4 else FULL for i in range(self.n_layers)]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.n_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types must be {self.n_layers} of {LINEAR!r}/{FULL!r}, got {self.layer_types}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.linear_n_v_heads % self.linear_n_k_heads:
            raise ValueError(f"linear value heads {self.linear_n_v_heads} not a multiple of key heads {self.linear_n_k_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} (head_dim * partial_rotary_factor) must be even, in 2..head_dim")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..{self.num_experts}")

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def family(self) -> str:
        return "qwen3_5_moe" if self.moe else "qwen3_5"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen35Config":
        return cls(**d)
