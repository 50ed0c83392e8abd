"""A compact Llama-family decoder: Llama 2/3, Qwen2 (qkv bias), Qwen3 (q/k norm), SmolLM.

One module, gpt-fast style: q/k/v fused into ``wqkv`` and gate/up into ``w13`` (fewer,
larger GEMVs per step). The KV cache is not a module buffer: it is a state pool with one row per
session that the runtime passes in, with the rows a call works on (see `attention`). Two methods:
a batched ``decode`` (one token for each of B sessions) and a one-session ``prefill`` chunk. Both
return only the last position's logits: generation never needs the others.

Checkpoint conversion is `hf_checkpoint` (and `gguf_file`); presets and random weights are
`presets` and `random_weights`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from .. import kernels
from . import invariant
from .attention import KVCache, Step, attend_pooled
from .base import MethodDef, PooledModel, as_method, pooled_methods
from .layers import FeedForward, RMSNorm, apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, swiglu
from .linear import matmul
from .packed import flatten, kernel_linear
from .projections import by_rows, fp8_rows, fused_decode, kernel_rows, linear, sum_of_squares


@dataclass
class LlamaConfig:
    """Shape and numerics of a Llama-family model."""

    family: ClassVar[str] = "llama"  # the registry's name for it (`families`)
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


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv_out = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, qkv_out, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: Step,
                cache: KVCache) -> torch.Tensor:
        """x: [N, T, dim] with N sessions of T tokens each (decode: T = 1; prefill: N = 1)."""
        return self.wo(self.attend(self.wqkv(x), cos, sin, step, cache))

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: Step,
               cache: KVCache) -> torch.Tensor:
        """The projected q/k/v [N, T, (Hq + 2 Hkv) D] through q/k norm, RoPE and attention -> [N, T, Hq D]."""
        n, t, _ = qkv.shape
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(n, t, self.n_heads, self.head_dim)
        k = k.view(n, t, self.n_kv_heads, self.head_dim)
        v = v.view(n, t, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)  # cos, sin: [N or 1, T, 1, D]
        k = apply_rope(k, cos, sin)
        return attend_pooled(q, k, v, step, cache).reshape(n, t, q_size)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: Step,
                cache: KVCache) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, step, cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def fused_decode(self, x: torch.Tensor, ss: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: Step,
                     cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer for a decode step's rows x [B, dim] on CUDA, with ``ss`` the partial sums of
        squares of x's rows: for a few sessions each projection is one kernel (norm + QKV; output +
        residual; norm + gate/up + SwiGLU; down + residual), for more the ops above (see `projections`);
        RoPE and the cache write run inside the attention kernel (`kernels.decode_attention_rope`).
        Returns the layer's output rows and their partial sums of squares (for the next norm)."""
        n = x.shape[0]
        attn, ffn, eps = self.attention, self.feed_forward, self.ffn_norm.eps
        qkv = linear(x, attn.wqkv.weight, attn.wqkv.bias, norm=(self.attention_norm.weight, ss, self.attention_norm.eps))
        c, s = cos[:, 0, 0], sin[:, 0, 0]
        fixed = invariant.active()  # the batch-invariant decode: a row's attention splits never depend on the batch
        if attn.qk_norm:
            y = attn.attend(qkv[:, None], cos, sin, step, cache)[:, 0]
        # Otherwise RoPE and the K/V cache write (quantizing, for an 8-bit cache) happen inside the attention kernel.
        elif cache.quantized:
            y = kernels.paged_decode_attention_rope_q8(qkv, c, s, cache.k, cache.v, cache.k_scale, cache.v_scale,
                                                       step.table, step.rows, step.input_pos, fixed,
                                                       cache.native).flatten(1)
        elif step.table is not None:
            y = kernels.paged_decode_attention_rope(qkv, c, s, cache.k, cache.v, step.table, step.rows,
                                                    step.input_pos, fixed).flatten(1)
        else:
            y = kernels.decode_attention_rope(qkv, c, s, cache.k, cache.v, step.rows, step.input_pos, fixed).flatten(1)
        dim = x.shape[1]
        weights = [attn.wo.weight, ffn.w13.weight, ffn.w2.weight]
        flat, unflatten = flatten(weights)

        def rest_few(y, x, g, *flat):
            wo, w13, w2 = unflatten(flat)
            h, ss_h = kernel_linear(y, wo, residual=x)
            return kernel_linear(kernel_linear(h, w13, glu=True, norm=(g, ss_h, eps))[0], w2, residual=h)

        def rest_many(y, x, g, *flat):
            wo, w13, w2 = unflatten(flat)
            h = x + matmul(y, wo)
            out = h + swiglu(rms_norm(h, g, eps), w13, w2)  # FeedForward's ops on the branch's operands
            # Same outputs as the few-rows branch; the sums are unused here (the norms recompute them).
            return out, out.new_empty((out.shape[0], kernels.small_linear_programs(dim, False)), dtype=torch.float32)

        operands = (y, x, self.ffn_norm.weight, *flat)
        if kernel_rows(weights, x):  # packed: the kernel for any number of rows (`projections.kernel_rows`)
            return rest_few(*operands)
        if fp8_rows(weights):  # FP8 without the native op: its GEMM for any number of rows
            return rest_many(*operands)
        return by_rows(n, rest_few, rest_many, operands)


class Transformer(PooledModel):
    """Llama-family decoder whose KV cache is a state pool passed in by the runtime.

    ``decode(tokens[B, 1], input_pos[B], rows[B], *pools) -> logits[B, vocab]``: one token for each
    of B sessions; ``prefill(tokens[N, T], input_pos[N, T], context[L], rows[N], *pools) -> logits[N, vocab]``:
    a chunk of each of N sessions' prompts, all T long (only each chunk's last position's logits: generation
    needs no others), chunk n attending to its row's filled positions only (L = the largest last position
    + 1; keys past a chunk's own positions are masked). One call prefills many prompts.
    ``pools`` are the `state_fqns` tensors in order, each [P, n_kv_heads, max_seq_len + 1, head_dim]; with
    ``kv_block`` (paged KV, the default export) they follow the block table [P, NBMAX] and are each
    [NB, n_kv_heads, kv_block, head_dim] (`attention.attend_paged`). With ``kv_dtype`` (int8 or fp8, paged
    only; `kv_quant`) each layer's K and V pools are 8-bit and followed by their scale pools [NB, n_kv_heads,
    kv_block].
    Calling the module itself (``model(tokens, input_pos)``) prefills one session whose state the
    module keeps: the eager reference the tests compare against.
    """

    kv_dtype: torch.dtype | None = None  # an 8-bit KV cache's storage dtype (set before export); None: self.dtype
    native_kernels: bool = True  # an 8-bit cache's CUDA decode through `kernels.native` where it serves (set before export)

    def __init__(self, cfg: LlamaConfig, max_seq_len: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config, self.max_seq_len, self.dtype = cfg, max_seq_len, dtype
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_norm_eps)
        if not cfg.tie_embeddings:
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.register_buffer("rope_inv_freq", inv_freq)
        self.to(dtype)
        self.rope_inv_freq.data = inv_freq  # RoPE angles stay in fp32 whatever the model dtype

    def state_specs(self) -> dict[str, tuple[list[int], torch.dtype]]:
        """Each state tensor's shape and dtype: every layer's K and V cache, per session row, or per block
        of ``kv_block`` positions when paged (then every state tensor is paged); an 8-bit cache adds each
        pool's float32 scales, one per position and head."""
        # One spare position: a prefill's context (at most max_seq_len) is then always a strict prefix of
        # the row, so export need not special-case a context that spans the whole row.
        length = self.kv_block or self.max_seq_len + 1
        shape = [self.config.n_kv_heads, length, self.config.head_dim]
        if self.kv_dtype is None:
            return {f"layers.{i}.attention.{n}": (shape, self.dtype) for i in range(len(self.layers))
                    for n in ("k_cache", "v_cache")}
        if not self.kv_block:
            raise ValueError("an 8-bit KV cache is paged: export it with a kv_block")
        return {f"layers.{i}.attention.{n}": spec for i in range(len(self.layers))
                for n, spec in (("k_cache", (shape, self.kv_dtype)), ("v_cache", (shape, self.kv_dtype)),
                                ("k_scale", (shape[:2], torch.float32)), ("v_scale", (shape[:2], torch.float32)))}

    def state_fqns(self) -> list[str]:
        return list(self.state_specs())

    def paged_state(self) -> list[str]:
        """The state tensors laid out in blocks (all of them when ``kv_block`` is set)."""
        return self.state_fqns() if self.kv_block else []

    def _caches(self, pools: tuple[torch.Tensor, ...]) -> list[KVCache]:
        """Each layer's KVCache from the pools in `state_specs` order."""
        per = 4 if self.kv_dtype is not None else 2
        return [KVCache(*pools[per * i:per * (i + 1)], native=self.native_kernels) for i in range(len(self.layers))]

    def _run(self, tokens: torch.Tensor, step: Step, pools: tuple[torch.Tensor, ...]) -> torch.Tensor:
        caches = self._caches(pools)
        x = self.tok_embeddings(tokens)
        cos, sin = rope_cos_sin(step.input_pos, self.rope_inv_freq, self.rope_scale, x.dtype, step.decode)
        w = self.tok_embeddings.weight if self.config.tie_embeddings else self.output.weight
        if fused_decode(x, step.decode):  # each norm folded into the projection after it
            x, ss = x[:, 0], sum_of_squares(x[:, 0])
            for i, layer in enumerate(self.layers):
                x, ss = layer.fused_decode(x, ss, cos, sin, step, caches[i])
            # The LM head's 2004 programs would each redo the norm on their x tiles: a norm kernel is cheaper.
            return linear(self.norm(x), w)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, step, caches[i])
        return matmul(self.norm(x[:, -1, :]), w)

    def decode(self, tokens: torch.Tensor, input_pos: torch.Tensor, rows: torch.Tensor,
               *pools: torch.Tensor) -> torch.Tensor:
        table, pools = self.split_table(pools)
        return self._run(tokens, Step(rows, input_pos, decode=True, table=table), pools)

    def prefill(self, tokens: torch.Tensor, input_pos: torch.Tensor, context: torch.Tensor, rows: torch.Tensor,
                *pools: torch.Tensor) -> torch.Tensor:
        torch._check(tokens.shape[1] <= context.shape[0])
        table, pools = self.split_table(pools)
        return self._run(tokens, Step(rows, input_pos, decode=False, context=context, table=table), pools)

    def prefill_inputs(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        positions = input_pos.view(tokens.shape)  # one chunk's [T] as [1, T]
        return tokens, positions, torch.arange(int(positions.max()) + 1, device=tokens.device)

    def export_methods(self, max_seq_len: int, device: str) -> dict[str, MethodDef]:
        """decode: B sessions x one token (B dynamic, graph-friendly per batch size); prefill: N sessions'
        chunks of 1..max_seq_len tokens each. Both take the rows and the state pools."""
        vocab = [0, self.config.vocab_size]
        return pooled_methods(self.state_specs(), max_seq_len, device, {
            "prefill": (as_method(self, Transformer.prefill), "prefill"),
            "decode": (as_method(self, Transformer.decode), "decode"),
        }, vocab, prefill_context=True, kv_block=self.kv_block, batched_prefill=True)
