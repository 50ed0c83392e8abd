"""The peers `onecopy bench` measures onecopy against, on the same weight tensors (views, no copy).

- `CompiledPeer`: a gpt-fast-style model (fused qkv and gate/up, static KV cache buffers, SDPA with
  a mask over the whole cache), decode compiled with torch.compile(mode="reduce-overhead",
  fullgraph=True), prefill with torch.compile(dynamic=True).
- `TinygemmPeer`: the same with torch's int4 weight-only GEMM (tinygemm) for the projections of an int4
  bundle (gpt-fast's and torchao's int4 recipe), on the bundle's own int4 values.
- `TransformersPeer`: transformers' LlamaForCausalLM with a static cache of max_seq_len, which its
  generate() compiles (reduce-overhead, fullgraph): what the transformers docs recommend for fast generation.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..models.layers import rope_inv_freq
from ..models.llama import LlamaConfig

if TYPE_CHECKING:
    from ..models.packed import Packed


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class CompiledPeer:
    """gpt-fast's recipe on onecopy's weights: one session, static cache, torch.compile."""

    def __init__(self, weights: dict[str, torch.Tensor], cfg: LlamaConfig, max_seq_len: int) -> None:
        self.w, self.cfg, self.max_seq_len = weights, cfg, max_seq_len
        dev, dtype = weights["norm.weight"].device, weights["norm.weight"].dtype
        shape = (1, cfg.n_kv_heads, max_seq_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=dev, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=dev, dtype=dtype) for _ in range(cfg.n_layers)]
        self.inv_freq, self.rope_scale = (t.to(dev) if isinstance(t, torch.Tensor) else t for t in rope_inv_freq(cfg))
        self.positions = torch.arange(max_seq_len, device=dev)
        # gpt-fast keeps weights and caches as module parameters and buffers, which torch.compile treats
        # as static: its CUDA graphs then read them in place and may mutate the caches. Tensors held in
        # plain attributes are graph inputs instead, and a mutated input makes it skip CUDA graphs.
        for t in (*weights.values(), *self.k, *self.v, self.positions):
            torch._dynamo.mark_static_address(t)
        self.decode_fn = torch.compile(self.forward, mode="reduce-overhead", fullgraph=True)
        self.prefill_fn = torch.compile(self.forward, fullgraph=True, dynamic=True)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        x = F.embedding(tokens, w["tok_embeddings.weight"])
        freqs = input_pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(x.dtype)[None, None]
        sin = (emb.sin() * self.rope_scale).to(x.dtype)[None, None]
        mask = input_pos[:, None] >= self.positions[None, :]
        t = tokens.shape[1]
        q_size, kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            h = _rms(x, w[p + "attention_norm.weight"], cfg.rms_norm_eps)
            q, k, v = self.linear(h, p + "attention.wqkv").split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(1, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)
            k = k.view(1, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
            v = v.view(1, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
            q = q * cos + _rotate(q) * sin
            k = k * cos + _rotate(k) * sin
            self.k[i][:, :, input_pos] = k
            self.v[i][:, :, input_pos] = v
            y = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, enable_gqa=True)
            x = x + self.linear(y.transpose(1, 2).reshape(1, t, q_size), p + "attention.wo")
            h = _rms(x, w[p + "ffn_norm.weight"], cfg.rms_norm_eps)
            gate, up = self.linear(h, p + "feed_forward.w13").split(cfg.intermediate_size, dim=-1)
            x = x + self.linear(F.silu(gate) * up, p + "feed_forward.w2")
        x = _rms(x[:, -1], w["norm.weight"], cfg.rms_norm_eps)
        if cfg.tie_embeddings:
            return F.linear(x, w["tok_embeddings.weight"])
        return self.linear(x, "output")

    def linear(self, x: torch.Tensor, layer: str) -> torch.Tensor:
        """The projection ``layer`` (a module name: its weight is ``<layer>.weight``) of x."""
        return F.linear(x, self.w[layer + ".weight"])

    @torch.no_grad()
    def generate(self, prompt: list[int], new_tokens: int) -> tuple[float, list[float]]:
        """Greedy: seconds to the first token, then the time of every further token (host clock, synced)."""
        dev = self.w["norm.weight"].device
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = self.prefill_fn(torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev))
        tok = logits.argmax(-1, keepdim=True)
        tok.cpu()
        ttft = time.perf_counter() - t0
        times = []
        pos = torch.tensor([len(prompt)], device=dev)
        for _ in range(new_tokens - 1):
            tok = self.decode_fn(tok, pos).argmax(-1, keepdim=True)
            pos += 1
            tok.cpu()  # the token reaches the host, as in any generation loop
            times.append(time.perf_counter())
        return ttft, times


class TinygemmPeer(CompiledPeer):
    """`CompiledPeer` whose projections are torch's int4 weight-only GEMM (``aten._weight_int4pack_mm``,
    "tinygemm": what torchao's int4 weight-only quantization and gpt-fast's int4 run) on the same int4 values
    as onecopy's bundle: ``int4`` maps a layer to its weight as `int4_operands` packs it."""

    def __init__(self, weights: dict[str, torch.Tensor], int4: dict[str, tuple[torch.Tensor, torch.Tensor, int]],
                 cfg: LlamaConfig, max_seq_len: int) -> None:
        self.int4 = int4
        for packed, sz, _ in int4.values():
            torch._dynamo.mark_static_address(packed)
            torch._dynamo.mark_static_address(sz)
        super().__init__(weights, cfg, max_seq_len)

    def linear(self, x: torch.Tensor, layer: str) -> torch.Tensor:
        if layer not in self.int4:
            return super().linear(x, layer)
        packed, sz, group = self.int4[layer]
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), packed, group, sz)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def int4_operands(w: "Packed") -> tuple[torch.Tensor, torch.Tensor, int]:
    """A 4-bit packed weight (q4a or q4z, any order) as ``aten._weight_int4pack_mm`` takes it: tinygemm computes
    (q - 8) * scale + zero, so zero = m + 8 s (q4a) or 0 (q4z); scales and zeros [K / group, N, 2] in bf16."""
    from ..models.packed import stored_order

    w = stored_order(w)
    if w.layout not in ("q4a", "q4z"):
        raise ValueError(f"tinygemm takes 4-bit weights (q4a, q4z), not {w.layout}")
    n, k = w.shape
    q = torch.stack((w.qweight & 0x0F, w.qweight >> 4), dim=-1).reshape(n, k).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), 8)
    zero = w.mins + 8 * w.scales if w.mins is not None else torch.zeros_like(w.scales)
    sz = torch.stack((w.scales.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz, w.group


class TransformersPeer:
    """LlamaForCausalLM on views of onecopy's weights, static cache, compiled forward."""

    def __init__(self, weights: dict[str, torch.Tensor], cfg: LlamaConfig, max_seq_len: int) -> None:
        import transformers

        from ..models.hf_checkpoint import hf_config_from_llama, onecopy_to_hf

        hf_cfg = transformers.LlamaConfig(**hf_config_from_llama(cfg))
        hf_cfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(hf_cfg)
        missing, unexpected = model.load_state_dict(onecopy_to_hf(weights, cfg), strict=False, assign=True)
        assert not unexpected and not missing, (missing, unexpected)
        dev = weights["norm.weight"].device
        model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg).to(dev)
        model.eval()
        # generate() compiles the forward itself (reduce-overhead, fullgraph) when the cache is static:
        # the documented path. Wrapping forward by hand broke its CUDA graphs (outputs overwritten).
        model.generation_config.cache_implementation = "static"
        # Its static cache is max_seq_len long, as the other systems' are. generate() otherwise sizes it to
        # prompt + new tokens and re-allocates (and re-compiles, inside a timed call) when a call needs more;
        # it keeps a cache at least as long as the longest one yet, so set that length up front.
        model.generation_config.max_cache_len = max_seq_len
        model._previous_max_cache_length = max_seq_len
        self.model, self.max_seq_len, self.device = model, max_seq_len, dev

    @torch.no_grad()
    def _run(self, prompt: list[int], n: int) -> float:
        ids = torch.tensor([prompt], device=self.device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                            pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[float, float]:
        """(seconds to the first token, ms per further token) from two timed generate calls."""
        first = self._run(prompt, 1)
        full = self._run(prompt, new_tokens)
        return first, 1000 * (full - first) / (new_tokens - 1)
