"""A compact Whisper (encoder-decoder) exported as two methods.

- ``encoder(mel[1, n_mels, 3000]) -> cross_kv[L, 2, 1, H, 1500, D]``: the audio encoder plus
  every decoder layer's cross-attention K/V, computed once per 30 s window. The output is kept
  on the device in a named session slot and fed to every decoder step.
- ``decoder(tokens[1, 1], input_pos[1], cross_kv) -> logits[1, vocab]``: one token, static shape
  (graph-friendly); its self-attention KV cache is the session state, mutated in place.

Parameter names follow transformers' WhisperForConditionalGeneration (``model.encoder...``), so
Hugging Face checkpoints load without renaming.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..bundle import InputSpec
from .base import MethodDef, as_method
from .llama import KVCache

N_FRAMES = 3000  # 30 s of 10 ms hops


@dataclass
class WhisperConfig:
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
    def __init__(self, cfg: WhisperConfig, max_seq_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        d, heads = cfg.d_model, cfg.decoder_heads
        self.self_attn = Attention(d, heads)
        self.self_attn.kv_cache = KVCache(heads, max_seq_len, d // heads, dtype)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = Attention(d, heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, cfg.decoder_ffn_dim), nn.Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, mask: torch.Tensor, cross_k: torch.Tensor,
                cross_v: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        h = self.self_attn_layer_norm(x)
        k, v = a.kv_cache.update(input_pos, a.split(a.k_proj(h)), a.split(a.v_proj(h)))
        x = x + a.merge(F.scaled_dot_product_attention(a.split(a.q_proj(h)), k, v, attn_mask=mask))
        c = self.encoder_attn
        h = self.encoder_attn_layer_norm(x)
        x = x + c.merge(F.scaled_dot_product_attention(c.split(c.q_proj(h)), cross_k, cross_v))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class Decoder(nn.Module):
    def __init__(self, cfg: WhisperConfig, max_seq_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, cfg.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg, max_seq_len, dtype) for _ in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)


class _Model(nn.Module):
    def __init__(self, cfg: WhisperConfig, max_seq_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg, max_seq_len, dtype)


class Whisper(nn.Module):
    """Holds ``model.encoder`` and ``model.decoder``; `encode` and `decode` are the two methods."""

    def __init__(self, cfg: WhisperConfig, max_seq_len: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not 1 <= max_seq_len <= cfg.max_target_positions:
            raise ValueError(f"max_seq_len must be in 1..{cfg.max_target_positions} for Whisper, got {max_seq_len}")
        self.config, self.max_seq_len = cfg, max_seq_len
        self.model = _Model(cfg, max_seq_len, dtype)
        self.to(dtype)

    def state_fqns(self) -> list[str]:
        return [f"model.decoder.layers.{i}.self_attn.kv_cache.{n}"
                for i in range(self.config.decoder_layers) for n in ("k_cache", "v_cache")]

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        h = self.model.encoder(mel)
        kv = []
        for layer in self.model.decoder.layers:
            c = layer.encoder_attn
            kv.append(torch.stack([c.split(c.k_proj(h)), c.split(c.v_proj(h))]))
        return torch.stack(kv)

    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor, cross_kv: torch.Tensor) -> torch.Tensor:
        dec = self.model.decoder
        x = dec.embed_tokens(tokens) + dec.embed_positions(input_pos)
        mask = input_pos[:, None] >= torch.arange(self.max_seq_len, device=tokens.device)[None, :]
        for i, layer in enumerate(dec.layers):
            x = layer(x, input_pos, mask, cross_kv[i, 0], cross_kv[i, 1])
        x = dec.layer_norm(x[:, -1, :])
        return F.linear(x, dec.embed_tokens.weight)

    def export_methods(self, max_seq_len: int, device: str) -> dict[str, MethodDef]:
        cfg = self.config
        dtype = self.model.encoder.conv1.weight.dtype
        heads, hd = cfg.decoder_heads, cfg.d_model // cfg.decoder_heads
        mel = torch.zeros(1, cfg.n_mels, N_FRAMES, dtype=dtype, device=device)
        kv_shape = [cfg.decoder_layers, 2, 1, heads, cfg.max_source_positions, hd]
        kv = torch.zeros(kv_shape, dtype=dtype, device=device)
        tok = torch.zeros(1, 1, dtype=torch.long, device=device)
        pos = torch.zeros(1, dtype=torch.long, device=device)
        dname = str(dtype).removeprefix("torch.")
        return {
            "encoder": MethodDef(as_method(self, Whisper.encode), (mel,), ({},),
                                 [InputSpec("mel", dname, [1, cfg.n_mels, N_FRAMES])]),
            "decoder": MethodDef(as_method(self, Whisper.decode), (tok, pos, kv), ({}, {}, {}),
                                 [InputSpec("tokens", "int64", [1, 1]), InputSpec("input_pos", "int64", [1]),
                                  InputSpec("cross_kv", dname, kv_shape)]),
        }
