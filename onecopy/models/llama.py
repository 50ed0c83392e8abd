"""A compact Llama-family decoder: Llama 2/3, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM.

One module, gpt-fast style: q/k/v fused into ``wqkv`` and gate/up into ``w13`` (fewer,
larger GEMVs per step), the KV cache as registered buffers written in place, and a single
``forward(tokens, input_pos)`` that serves both prefill (dynamic length) and decode (one
token). It returns only the last position's logits: generation never needs the others.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..bundle import InputSpec
from .base import MethodDef


@dataclass
class LlamaConfig:
    """Shape and numerics of a Llama-family model."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: dim // n_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        return cls(**d)


def rope_inv_freq(cfg: LlamaConfig) -> tuple[torch.Tensor, float]:
    """Inverse RoPE frequencies and the cos/sin scale for the config's scaling variant.

    Follows transformers' ``ROPE_INIT_FUNCTIONS`` for default, linear, llama3 and yarn.
    """
    dim = cfg.head_dim
    base = cfg.rope_theta
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(cfg.rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(medium, smoothed, out), 1.0
    if kind == "yarn":
        factor = scaling["factor"]
        old_ctx = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
        beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)
        mscale = scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def corr_dim(rot: float) -> float:
            return (dim * math.log(old_ctx / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo = max(math.floor(corr_dim(beta_fast)), 0)
        hi = min(math.ceil(corr_dim(beta_slow)), dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        extrapolation = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv, float(mscale)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, yarn")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as transformers (normalize in fp32, scale in the model dtype).
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class KVCache(nn.Module):
    """Batch-1 KV cache: buffers the compiled methods mutate in place (session state)."""

    def __init__(self, n_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (1, n_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype))

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_seq_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, qkv_out, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.kv_cache = KVCache(cfg.n_kv_heads, max_seq_len, cfg.head_dim, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_heads, self.head_dim)
        k = k.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_all, v_all = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                           enable_gqa=self.n_heads != self.n_kv_heads)
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, q_size))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.hidden = cfg.intermediate_size
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split([self.hidden, self.hidden], dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_seq_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.attention = Attention(cfg, max_seq_len, dtype)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, input_pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``forward(tokens[1, T] int64, input_pos[T] int64) -> logits[1, vocab]`` of the last position."""

    def __init__(self, cfg: LlamaConfig, max_seq_len: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.max_seq_len = cfg, max_seq_len
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, max_seq_len, dtype) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        if not cfg.tie_embeddings:
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.register_buffer("rope_inv_freq", inv_freq)
        self.to(dtype)
        self.rope_inv_freq.data = inv_freq  # RoPE angles stay in fp32 whatever the model dtype

    def state_fqns(self) -> list[str]:
        """FQNs of the buffers the forward mutates in place: the per-session state."""
        return [f"layers.{i}.attention.kv_cache.{n}" for i in range(len(self.layers)) for n in ("k_cache", "v_cache")]

    def export_methods(self, max_seq_len: int, device: str) -> dict[str, MethodDef]:
        """prefill: dynamic length 2..max_seq_len; decode: one token (static shape, graph-friendly)."""
        long = dict(dtype=torch.long, device=device)
        n = min(8, max_seq_len)
        seq = torch.export.Dim("seq_len", min=2, max=max_seq_len)
        dim = {"min": 2, "max": max_seq_len}
        methods = {"decode": MethodDef(self, (torch.zeros(1, 1, **long), torch.zeros(1, **long)), ({}, {}),
                                       [InputSpec("tokens", "int64", [1, 1]), InputSpec("input_pos", "int64", [1])])}
        if max_seq_len >= 2:
            methods["prefill"] = MethodDef(self, (torch.zeros(1, n, **long), torch.arange(n, device=device)),
                                           ({1: seq}, {0: seq}),
                                           [InputSpec("tokens", "int64", [1, dim]), InputSpec("input_pos", "int64", [dim])])
        return {k: methods[k] for k in ("prefill", "decode") if k in methods}

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        # RoPE angles computed from positions in fp32, as transformers does.
        freqs = input_pos.float()[:, None] * self.rope_inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(x.dtype)
        sin = (emb.sin() * self.rope_scale).to(x.dtype)
        mask = input_pos[:, None] >= torch.arange(self.max_seq_len, device=tokens.device)[None, :]
        for layer in self.layers:
            x = layer(x, cos, sin, input_pos, mask)
        x = self.norm(x[:, -1, :])
        if self.config.tie_embeddings:
            return F.linear(x, self.tok_embeddings.weight)
        return self.output(x)


@dataclass
class Preset:
    config: LlamaConfig
    description: str
    extra: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, Preset] = {
    "tiny-llama": Preset(
        LlamaConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                    max_position_embeddings=256, rope_theta=10000.0),
        "seeded random 2-layer Llama for tests"),
    "llama-8l-2048": Preset(
        LlamaConfig(vocab_size=32000, dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, intermediate_size=5632,
                    max_position_embeddings=4096, rope_theta=500000.0),
        "seeded random 8-layer, 2048-wide Llama for benchmarks"),
}
