"""Qwen3.5 (dense ``qwen3_5`` and MoE ``qwen3_5_moe``): a hybrid of gated DeltaNet and gated attention.

Most layers are gated DeltaNet linear attention (`qwen3_5_deltanet`), whose per-session state is a
causal-conv window and a recurrent matrix per value head; the others (``layer_types``) are gated
full attention with q/k norms and partial rotary embeddings over a KV cache. The math follows
transformers' ``modeling_qwen3_5`` / ``modeling_qwen3_5_moe`` (text only: the three mrope sections
see the same positions, so mrope is plain rotary over the first ``head_dim * partial_rotary_factor``
dims).

Like `llama.Transformer`, the state is not module buffers but pools passed in by the runtime, one
row per session. A call starting at position 0 starts from a zero state whatever the row holds (the
KV cache is position-addressed, the recurrent state is not: this keeps "prefill from 0 starts over"
true). The DeltaNet prefill runs in `Qwen35.prefill_chunks` chunks (ceil(max_seq_len /
linear_chunk_size), at most `MAX_PREFILL_CHUNKS`: a static trip count).

The config is `qwen3_5_config.Qwen35Config`; checkpoint conversion is `qwen3_5_convert`; the presets and
their random weights are `presets`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..kernels import moe
from . import invariant
from .attention import KVCache, Step, attend_pooled
from .base import MethodDef, PooledModel, as_method, pooled_methods
from .layers import FeedForward, apply_rope, rope_cos_sin, rope_inv_freq
from .packed import expert_rows
from .qwen3_5_config import LINEAR, Qwen35Config
from .qwen3_5_deltanet import GatedDeltaNet

MAX_PREFILL_CHUNKS = 32  # most sequential chunk steps in one prefill graph (chunks grow beyond that)


# ----------------------------------------------------------------------------------------------- layers

class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: ``norm(x) * (1 + w)`` in fp32, then the input dtype (transformers' order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class Attention(nn.Module):
    """Gated full attention: q (with its per-head output gate), k, v fused in ``wqkv``; q/k norms; partial RoPE."""

    def __init__(self, cfg: Qwen35Config) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        q2, kv = 2 * cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, q2 + 2 * kv, bias=cfg.attention_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: Step,
                k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        hd, q_size, kv_size = self.head_dim, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        qg, k, v = self.wqkv(x).split([2 * q_size, kv_size, kv_size], dim=-1)
        q, gate = qg.view(n, t, self.n_heads, 2 * hd).chunk(2, dim=-1)  # per head: [query | gate]
        q = apply_rope(self.q_norm(q), cos, sin, self.rotary_dim)
        k = apply_rope(self.k_norm(k.view(n, t, self.n_kv_heads, hd)), cos, sin, self.rotary_dim)
        v = v.view(n, t, self.n_kv_heads, hd)
        y = attend_pooled(q, k, v, step, KVCache(k_pool, v_pool))
        y = y.reshape(n, t, q_size) * torch.sigmoid(gate.reshape(n, t, q_size))
        return self.wo(y)


class Experts(nn.Module):
    """Routed experts as transformers stores them: gate_up_proj [E, 2I, dim], down_proj [E, dim, I]; either may be
    a packed stack (`packed.PackedExperts`, ``--quantize``), read through `packed.expert_rows`."""

    def __init__(self, n: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.n, self.hidden = n, hidden
        self.gate_up_proj = nn.Parameter(torch.zeros(n, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.zeros(n, dim, hidden))

    def routed(self, x: torch.Tensor, idx: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """Decode: each token through its own top-k experts only. x: [N, dim]; idx, top: [N, k].

        Written as gathers feeding mul + sum reductions, which Inductor fuses: the kernels read only
        the routed experts' weights, in place (N * k experts' bytes a step, not all E). With `kernels.moe.ENABLED`
        (off: slower below 16 rows) float experts on CUDA take the grouped kernels instead: each chosen expert read once.
        """
        hid = self.hidden
        if (moe.ENABLED and x.is_cuda and kernels.available() and not invariant.active()
                and isinstance(self.gate_up_proj, torch.Tensor) and isinstance(self.down_proj, torch.Tensor)):
            return kernels.moe_routed(x, idx, top, self.gate_up_proj, self.down_proj)  # each chosen expert read once
        gu = (expert_rows(self.gate_up_proj, idx, x.dtype) * x[:, None, None, :]).sum(-1)  # [N, k, 2I]
        gate, up = gu.split([hid, hid], dim=-1)
        act = F.silu(gate) * up  # [N, k, I]
        y = (expert_rows(self.down_proj, idx, x.dtype) * act[:, :, None, :]).sum(-1)  # [N, k, dim]
        return (y * top[..., None]).sum(1)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Prefill: x: [N, dim]; weights: [N, E] routing weights, zero for experts a token does not use.

        Every expert runs on every token (static shapes, no data-dependent dispatch): E / top_k
        times the FLOPs of a grouped kernel, but each expert's weights are read once for the chunk.
        """
        e, hid = self.n, self.hidden
        gate_up = expert_rows(self.gate_up_proj, None, x.dtype)
        gu = F.linear(x, gate_up.reshape(e * 2 * hid, -1)).view(x.shape[0], e, 2 * hid)
        gate, up = gu.split([hid, hid], dim=-1)
        act = (F.silu(gate) * up).transpose(0, 1)  # [E, N, I]
        y = torch.bmm(act, expert_rows(self.down_proj, None, x.dtype).transpose(1, 2))  # [E, N, dim]
        return (y * weights.t()[:, :, None]).sum(0)


class SparseMoe(nn.Module):
    """Softmax top-k router (renormalised), routed experts, and a shared expert behind a sigmoid gate."""

    def __init__(self, cfg: Qwen35Config) -> None:
        super().__init__()
        self.top_k, self.n_experts = cfg.num_experts_per_tok, cfg.num_experts
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.dim, cfg.moe_intermediate_size)
        self.shared_expert = FeedForward(cfg.dim, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.dim, 1, bias=False)

    def forward(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits = self.gate(h)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        top = (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype)
        if decode:
            routed = self.experts.routed(h, idx, top)
        else:
            routed = self.experts(h, torch.zeros_like(logits).scatter(1, idx, top))  # [N, E] routing weights
        shared = torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return (routed + shared).reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg: Qwen35Config, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.mlp = SparseMoe(cfg) if cfg.moe else FeedForward(cfg.dim, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: Step, pool_a: torch.Tensor,
                pool_b: torch.Tensor, n_chunks: int) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.kind == LINEAR:
            h = self.linear_attn(h, step, pool_a, pool_b, n_chunks)
        else:
            h = self.self_attn(h, cos, sin, step, pool_a, pool_b)
        x = x + h
        if isinstance(self.mlp, SparseMoe):
            return x + self.mlp(self.post_attention_layernorm(x), step.decode)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35(PooledModel):
    """Qwen3.5 decoder whose state (conv windows, recurrent matrices, KV caches) is pools passed in.

    ``decode(tokens[B, 1], input_pos[B], rows[B], *pools) -> logits[B, vocab]``;
    ``prefill(tokens[1, T], input_pos[T], rows[1], *pools) -> logits[1, vocab]`` (last position).
    ``pools`` are the `state_fqns` tensors in order, two per layer (DeltaNet: conv_state,
    recurrent_state; attention: k_cache, v_cache). ``model(tokens, input_pos)`` runs one session
    on a state the module keeps: the eager reference.
    """

    def __init__(self, cfg: Qwen35Config, max_seq_len: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.max_seq_len, self.dtype = cfg, max_seq_len, dtype
        self.prefill_chunks = max(1, min(MAX_PREFILL_CHUNKS, -(-max_seq_len // cfg.linear_chunk_size)))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, kind) for kind in cfg.layer_types)
        self.norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        inv_freq, self.rope_scale = rope_inv_freq(cfg, cfg.rotary_dim)  # over the rotary part of the head
        self.register_buffer("rope_inv_freq", inv_freq)
        self.to(dtype)
        self.rope_inv_freq.data = inv_freq  # RoPE angles stay in fp32 whatever the model dtype

    def materialize_buffers(self, device: str | torch.device = "cpu") -> None:
        """The computed buffers (the RoPE table) of a model built on the meta device, on ``device``."""
        self.rope_inv_freq = rope_inv_freq(self.config, self.config.rotary_dim)[0].to(device)

    def state_specs(self) -> dict[str, tuple[list[int], torch.dtype]]:
        cfg, out = self.config, {}
        for i, layer in enumerate(self.layers):
            if layer.kind == LINEAR:
                la = layer.linear_attn
                out[f"layers.{i}.linear_attn.conv_state"] = ([la.conv_dim, la.kernel], self.dtype)
                out[f"layers.{i}.linear_attn.recurrent_state"] = ([la.nv, la.dk, la.dv], torch.float32)
            else:
                kv = [cfg.n_kv_heads, self.max_seq_len, cfg.head_dim]
                out[f"layers.{i}.self_attn.k_cache"] = (kv, self.dtype)
                out[f"layers.{i}.self_attn.v_cache"] = (kv, self.dtype)
        return out

    def state_fqns(self) -> list[str]:
        return list(self.state_specs())

    def recurrent_state(self) -> list[str]:
        """State that is not addressed by position (conv windows, recurrent matrices): a step written into
        it cannot be undone by moving the position back, unlike a KV cache."""
        return [f for f in self.state_specs() if ".linear_attn." in f]

    def _run(self, tokens: torch.Tensor, step: Step, pools: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        cos, sin = rope_cos_sin(step.input_pos, self.rope_inv_freq, self.rope_scale, x.dtype, step.decode)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, step, pools[2 * i], pools[2 * i + 1], self.prefill_chunks)
        x = self.norm(x[:, -1, :])
        return F.linear(x, self.embed_tokens.weight) if self.config.tie_embeddings else self.lm_head(x)

    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor, rows: torch.Tensor,
               *pools: torch.Tensor) -> torch.Tensor:
        return self._run(tokens, Step(rows, input_pos, decode=True), pools)

    def prefill(self, tokens: torch.Tensor, input_pos: torch.Tensor, rows: torch.Tensor,
                *pools: torch.Tensor) -> torch.Tensor:
        return self._run(tokens, Step(rows, input_pos, decode=False), pools)

    def export_methods(self, max_seq_len: int, device: str) -> dict[str, MethodDef]:
        vocab = [0, self.config.vocab_size]
        return pooled_methods(self.state_specs(), max_seq_len, device, {
            "prefill": (as_method(self, Qwen35.prefill), "prefill"),
            "decode": (as_method(self, Qwen35.decode), "decode"),
        }, vocab)
