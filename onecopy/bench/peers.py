"""The peers `onecopy bench` measures onecopy against, on the same weight tensors (views, no copy).

- `CompiledPeer`: a gpt-fast-style model (fused qkv and gate/up, static KV cache buffers, SDPA with
  a mask over the whole cache), decode compiled with torch.compile(mode="reduce-overhead",
  fullgraph=True), prefill with torch.compile(dynamic=True).
- `TransformersPeer`: transformers' LlamaForCausalLM with a static cache of max_seq_len, which its
  generate() compiles (reduce-overhead, fullgraph): what the transformers docs recommend for fast generation.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..models.layers import rope_inv_freq
from ..models.llama import LlamaConfig


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
            q, k, v = F.linear(h, w[p + "attention.wqkv.weight"]).split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(1, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)
            k = k.view(1, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
            v = v.view(1, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
            q = q * cos + _rotate(q) * sin
            k = k * cos + _rotate(k) * sin
            self.k[i][:, :, input_pos] = k
            self.v[i][:, :, input_pos] = v
            y = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, enable_gqa=True)
            x = x + F.linear(y.transpose(1, 2).reshape(1, t, q_size), w[p + "attention.wo.weight"])
            h = _rms(x, w[p + "ffn_norm.weight"], cfg.rms_norm_eps)
            gate, up = F.linear(h, w[p + "feed_forward.w13.weight"]).split(cfg.intermediate_size, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w[p + "feed_forward.w2.weight"])
        x = _rms(x[:, -1], w["norm.weight"], cfg.rms_norm_eps)
        head = w["tok_embeddings.weight"] if cfg.tie_embeddings else w["output.weight"]
        return F.linear(x, head)

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
