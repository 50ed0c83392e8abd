"""A compact Whisper (encoder-decoder) exported as two methods over one state pool.

- ``encoder(mel[1, n_mels, 3000], rows[1], *cross pools)``: the audio encoder plus every decoder
  layer's cross-attention K/V, computed once per 30 s window and written into the session's row
  of the cross-attention pools (state that stays on the device for every decoder step).
- ``decoder(tokens[B, 1], input_pos[B], rows[B], *self pools, *cross pools) -> logits[B, vocab]``:
  one token for each of B sessions (batched, graph-friendly); it writes its self-attention K/V
  into the rows and reads the rows' cross K/V, both without copying a row.

Parameter names follow transformers' WhisperForConditionalGeneration (``model.encoder...``), so
Hugging Face checkpoints load without renaming.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..bundle import InputSpec, dtype_name
from .attention import pooled_attention, write_rows
from .base import MethodDef, as_method, example_pools, pooled_methods

N_FRAMES = 3000  # 30 s of 10 ms hops


@dataclass
class WhisperConfig:
    family: ClassVar[str] = "whisper"  # the registry's name for it (`families`)
    vocab_size: int = 51864
    n_mels: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    encoder_heads: int = 6
    decoder_layers: int = 4
    decoder_heads: int = 6
    encoder_ffn_dim: int = 1536
    decoder_ffn_dim: int = 1536
    max_source_positions: int = 1500
    max_target_positions: int = 448

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WhisperConfig":
        return cls(**d)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = y.shape
        return self.out_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = Attention(d, cfg.encoder_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, cfg.encoder_ffn_dim), nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        h = self.self_attn_layer_norm(x)
        y = F.scaled_dot_product_attention(a.split(a.q_proj(h)), a.split(a.k_proj(h)), a.split(a.v_proj(h)))
        x = x + a.merge(y)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class Encoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(cfg.n_mels, cfg.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.d_model, cfg.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.d_model)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2)
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d, heads = cfg.d_model, cfg.decoder_heads
        self.self_attn = Attention(d, heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = Attention(d, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, cfg.decoder_ffn_dim), nn.Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, rows: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, cross_k: torch.Tensor, cross_v: torch.Tensor) -> torch.Tensor:
        """x: [B, 1, d], one token of each session."""
        a = self.self_attn
        h = self.self_attn_layer_norm(x)
        write_rows(k_pool, rows, input_pos, a.split(a.k_proj(h))[:, :, 0])
        write_rows(v_pool, rows, input_pos, a.split(a.v_proj(h))[:, :, 0])
        q = a.split(a.q_proj(h))[:, :, 0]
        x = x + a.merge(pooled_attention(q, k_pool, v_pool, rows, input_pos + 1)[:, :, None])
        c = self.encoder_attn
        h = self.encoder_attn_layer_norm(x)
        x = x + c.merge(pooled_attention(c.split(c.q_proj(h))[:, :, 0], cross_k, cross_v, rows, None)[:, :, None])
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class Decoder(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, cfg.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)


class _Model(nn.Module):
    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)


class Whisper(nn.Module):
    """Holds ``model.encoder`` and ``model.decoder``; `encode` and `decode` are the two methods."""

    def __init__(self, cfg: WhisperConfig, max_seq_len: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not 1 <= max_seq_len <= cfg.max_target_positions:
            raise ValueError(f"max_seq_len must be in 1..{cfg.max_target_positions} for Whisper, got {max_seq_len}")
        self.config, self.max_seq_len, self.dtype = cfg, max_seq_len, dtype
        self.model = _Model(cfg)
        self.to(dtype)

    def state_specs(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """Per session: each decoder layer's self-attention K/V cache and its cross-attention K/V."""
        cfg = self.config
        hd = cfg.d_model // cfg.decoder_heads
        specs = {}  # every layer's self-attention cache first, then every layer's cross K/V: decode's order
        for attn, length in (("self_attn", self.max_seq_len), ("encoder_attn", cfg.max_source_positions)):
            for i in range(cfg.decoder_layers):
                for n in ("k_cache", "v_cache"):
                    specs[f"model.decoder.layers.{i}.{attn}.{n}"] = ([cfg.decoder_heads, length, hd], self.dtype)
        return specs

    def state_fqns(self) -> list[str]:
        return list(self.state_specs())

    def cross_fqns(self) -> list[str]:
        return [f for f in self.state_specs() if ".encoder_attn." in f]

    def encode(self, mel: torch.Tensor, rows: torch.Tensor, *cross: torch.Tensor) -> tuple:
        """Encode one 30 s window and write every layer's cross K/V into row ``rows[0]``."""
        h = self.model.encoder(mel)
        for i, layer in enumerate(self.model.decoder.layers):
            c = layer.encoder_attn
            cross[2 * i].index_copy_(0, rows, c.split(c.k_proj(h)))
            cross[2 * i + 1].index_copy_(0, rows, c.split(c.v_proj(h)))
        return ()

    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor, rows: torch.Tensor,
               *state: torch.Tensor) -> torch.Tensor:
        """state: the self-attention pools (K, V per layer), then the cross-attention pools."""
        dec = self.model.decoder
        n = len(dec.layers)
        x = dec.embed_tokens(tokens) + dec.embed_positions(input_pos)[:, None]
        for i, layer in enumerate(dec.layers):
            x = layer(x, input_pos, rows, state[2 * i], state[2 * i + 1], state[2 * n + 2 * i], state[2 * n + 2 * i + 1])
        x = dec.layer_norm(x[:, -1, :])
        return F.linear(x, dec.embed_tokens.weight)

    def export_methods(self, max_seq_len: int, device: str) -> dict[str, MethodDef]:
        cfg = self.config
        specs = self.state_specs()
        cross = self.cross_fqns()
        mel = torch.zeros(1, cfg.n_mels, N_FRAMES, dtype=self.dtype, device=device)
        pools, pool_dims = example_pools(specs, cross, device)
        encoder = MethodDef(as_method(self, Whisper.encode), (mel, torch.zeros(1, dtype=torch.long, device=device)) + pools,
                            ({}, {}, pool_dims), [InputSpec("mel", dtype_name(self.dtype), [1, cfg.n_mels, N_FRAMES])],
                            "encode", cross)
        decoders = pooled_methods(specs, max_seq_len, device, {"decoder": (as_method(self, Whisper.decode), "decode")},
                                  [0, cfg.vocab_size])  # on CUDA also decoder_invariant
        return {"encoder": encoder, **decoders}
