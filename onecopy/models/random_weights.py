"""Seeded random weights for the presets and the tests, scaled so that logits stay well separated
(greedy ties would make tests flaky).

Small presets draw their weights on the host under transformers' names (`llama_hf_weights`,
`qwen3_5_hf_weights`, reached through `presets.random_hf_state_dict`): the same seed gives the same
tensors, bit for bit, which the tests' references rely on. Large presets draw them in place on the
export device, in its dtype (`fill_random`, `llama_on_device`, `qwen3_5_on_device`): an 8B (or 35B)
model never passes through host memory in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .layers import rope_inv_freq
from .llama import LlamaConfig, Transformer
from .quantize import quantize_model, quantize_qwen3_5
from .qwen3_5_config import LINEAR, Qwen35Config


class Draws:
    """Tensors drawn from one seeded generator in call order: the order of the calls fixes every value."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g)

    def fan_in(self, *shape: int) -> torch.Tensor:
        """N(0, 1 / shape[-1]): a linear weight [out, in] (or a stack of them) keeps activations O(1)."""
        return self.normal(*shape) / shape[-1] ** 0.5

    def small(self, *shape: int) -> torch.Tensor:
        """N(0, 0.01): biases, and norm weights around their centre (1 + small, or small when zero-centred)."""
        return 0.1 * self.normal(*shape)

    def uniform(self, n: int, low: float, high: float) -> torch.Tensor:
        return torch.empty(n).uniform_(low, high, generator=self.g)

    def mlp(self, sd: dict[str, torch.Tensor], prefix: str, dim: int, hidden: int) -> None:
        """A SwiGLU MLP's gate, up and down projections under ``prefix`` (transformers' names)."""
        sd[prefix + "gate_proj.weight"] = self.fan_in(hidden, dim)
        sd[prefix + "up_proj.weight"] = self.fan_in(hidden, dim)
        sd[prefix + "down_proj.weight"] = self.fan_in(dim, hidden)


def llama_hf_weights(cfg: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """A Llama-family model's seeded weights under transformers' names."""
    d = Draws(seed)
    hd, sd = cfg.head_dim, {"model.embed_tokens.weight": d.normal(cfg.vocab_size, cfg.dim)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = d.fan_in(cfg.n_heads * hd, cfg.dim)
        sd[p + "self_attn.k_proj.weight"] = d.fan_in(cfg.n_kv_heads * hd, cfg.dim)
        sd[p + "self_attn.v_proj.weight"] = d.fan_in(cfg.n_kv_heads * hd, cfg.dim)
        if cfg.qkv_bias:
            for n, size in (("q", cfg.n_heads), ("k", cfg.n_kv_heads), ("v", cfg.n_kv_heads)):
                sd[p + f"self_attn.{n}_proj.bias"] = d.small(size * hd)
        if cfg.qk_norm:
            sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"] = 1.0 + d.small(hd), 1.0 + d.small(hd)
        sd[p + "self_attn.o_proj.weight"] = d.fan_in(cfg.dim, cfg.n_heads * hd)
        d.mlp(sd, p + "mlp.", cfg.dim, cfg.intermediate_size)
        sd[p + "input_layernorm.weight"] = 1.0 + d.small(cfg.dim)
        sd[p + "post_attention_layernorm.weight"] = 1.0 + d.small(cfg.dim)
    sd["model.norm.weight"] = 1.0 + d.small(cfg.dim)
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = d.fan_in(cfg.vocab_size, cfg.dim)
    return sd


def qwen3_5_hf_weights(cfg: Qwen35Config, seed: int) -> dict[str, torch.Tensor]:
    """A Qwen3.5 model's (dense or MoE) seeded weights under transformers' names. Its RMSNorms scale by
    ``1 + w``, so their weights are drawn around zero (the DeltaNet output norm's around one)."""
    d = Draws(seed)
    hd, dim = cfg.head_dim, cfg.dim
    sd = {"model.embed_tokens.weight": d.normal(cfg.vocab_size, dim)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        if kind == LINEAR:
            la = p + "linear_attn."
            key_dim, value_dim = cfg.linear_n_k_heads * cfg.linear_k_head_dim, cfg.linear_n_v_heads * cfg.linear_v_head_dim
            nv, kern = cfg.linear_n_v_heads, cfg.linear_conv_kernel
            sd[la + "in_proj_qkv.weight"] = d.fan_in(2 * key_dim + value_dim, dim)
            sd[la + "in_proj_z.weight"] = d.fan_in(value_dim, dim)
            sd[la + "in_proj_b.weight"] = d.fan_in(nv, dim)
            sd[la + "in_proj_a.weight"] = d.fan_in(nv, dim)
            sd[la + "conv1d.weight"] = d.fan_in(2 * key_dim + value_dim, 1, kern)
            sd[la + "dt_bias"] = 1.0 + d.small(nv)
            sd[la + "A_log"] = d.uniform(nv, 0.05, 2.0).log()
            sd[la + "norm.weight"] = 1.0 + d.small(cfg.linear_v_head_dim)
            sd[la + "out_proj.weight"] = d.fan_in(dim, value_dim)
        else:
            sa = p + "self_attn."
            sd[sa + "q_proj.weight"] = d.fan_in(2 * cfg.n_heads * hd, dim)
            sd[sa + "k_proj.weight"] = d.fan_in(cfg.n_kv_heads * hd, dim)
            sd[sa + "v_proj.weight"] = d.fan_in(cfg.n_kv_heads * hd, dim)
            if cfg.attention_bias:
                for n, size in (("q", 2 * cfg.n_heads * hd), ("k", cfg.n_kv_heads * hd), ("v", cfg.n_kv_heads * hd),
                                ("o", dim)):
                    sd[sa + f"{n}_proj.bias"] = d.small(size)
            sd[sa + "o_proj.weight"] = d.fan_in(dim, cfg.n_heads * hd)
            sd[sa + "q_norm.weight"], sd[sa + "k_norm.weight"] = d.small(hd), d.small(hd)
        m = p + "mlp."
        if cfg.moe:
            e, hid = cfg.num_experts, cfg.moe_intermediate_size
            sd[m + "gate.weight"] = d.fan_in(e, dim)
            sd[m + "experts.gate_up_proj"] = d.fan_in(e, 2 * hid, dim)
            sd[m + "experts.down_proj"] = d.fan_in(e, dim, hid)
            m, hid = m + "shared_expert.", cfg.shared_expert_intermediate_size
            sd[p + "mlp.shared_expert_gate.weight"] = d.fan_in(1, dim)
        else:
            hid = cfg.intermediate_size
        d.mlp(sd, m, dim, hid)
        sd[p + "input_layernorm.weight"] = d.small(dim)
        sd[p + "post_attention_layernorm.weight"] = d.small(dim)
    sd["model.norm.weight"] = d.small(dim)
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = d.fan_in(cfg.vocab_size, dim)
    return sd


def normal_like(p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """N(0, 1) of ``p``'s shape on its device: float32 on the CPU (its generator's stream), else ``p``'s dtype."""
    return torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32 if p.device.type == "cpu" else p.dtype)


def llama_draw(name: str, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A Llama-family tensor's values: linear weights N(0, 1/fan_in), norms 1 + N(0, 0.01), biases N(0, 0.01),
    embeddings N(0, 1); logits stay well separated."""
    x = normal_like(p, g)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * x
    if p.dim() == 2 and "embeddings" not in name:
        return x / p.shape[1] ** 0.5
    if p.dim() == 1:  # biases
        return 0.1 * x
    return x


def qwen3_5_draw(name: str, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A Qwen3.5 tensor's values, scaled as `qwen3_5_hf_weights` scales them: projections and experts
    N(0, 1 / fan_in) (an expert tensor [E, out, in]: fan-in ``in``; the causal conv: its kernel), the
    zero-centred RMSNorms (``1 + w``) small, the DeltaNet output norm (``w``) around one, decay rates
    A = exp(A_log) in 0.05..2, the embedding N(0, 1)."""
    if name.endswith("A_log"):
        return (0.05 + 1.95 * torch.rand(p.shape, generator=g, device=p.device, dtype=torch.float32)).log()
    x = normal_like(p, g)
    if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
        return 1.0 + 0.1 * x
    if p.dim() == 1:  # zero-centred norms, biases
        return 0.1 * x
    if name == "embed_tokens.weight":
        return x
    fan_in = p.shape[-1] if ".experts." in name else p[0].numel()
    return x / fan_in ** 0.5


def fill_random(model: nn.Module, seed: int,
                draw: Callable[[str, torch.Tensor, torch.Generator], torch.Tensor] = llama_draw,
                prefix: str = "", index: dict[str, int] | None = None) -> None:
    """Seeded random weights in place, on the model's device and dtype: one generator per tensor, seeded by the
    tensor's index among the model's parameters, its values ``draw(name, tensor, generator)`` (the family's
    scales). ``model`` may be a part of the model: ``prefix`` its name in the whole, ``index`` the whole's
    parameter indices (the same values as filling the whole)."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            name = prefix + name
            i = i if index is None else index[name]
            p.copy_(draw(name, p, torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)))


def llama_on_device(cfg: LlamaConfig, max_seq_len: int, dtype: torch.dtype, device: torch.device,
                    seed: int, quantize: tuple[str, int] | None = None) -> Transformer:
    """A Transformer built without memory (meta), then materialised on ``device`` with seeded random weights:
    an 8B model never passes through host memory in fp32. ``quantize`` = (mode, group): its projections then
    quantized (`quantize.quantize_model`)."""
    with torch.device("meta"):
        model = Transformer(cfg, max_seq_len, dtype)
    model = model.to_empty(device=device)
    model.rope_inv_freq = rope_inv_freq(cfg)[0].to(device)  # computed, not random
    fill_random(model, seed)
    if quantize is not None:
        quantize_model(model, *quantize)
    return model.eval()


def qwen3_5_on_device(cfg: Qwen35Config, max_seq_len: int, dtype: torch.dtype, device: torch.device,
                      seed: int, quantize: tuple[str, int] | None = None) -> nn.Module:
    """A Qwen3.5 model (dense or MoE) built without memory (meta), then materialised on ``device`` with seeded
    random weights drawn in place (`qwen3_5_draw`): the 35B MoE shape never passes through the host. A layer at a
    time (`fill_random` of each part: the same values as over the whole model), and with ``quantize`` = (mode,
    group) each layer is quantized (`quantize.quantize_qwen3_5`) as soon as it is drawn: the 35B shape in int4
    never holds its ~70 GB of bf16 at once."""
    from .qwen3_5 import Qwen35  # the model module imports this one's neighbours; keep the import local

    with torch.device("meta"):
        model = Qwen35(cfg, max_seq_len, dtype)
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    units: list[tuple[str, nn.Module]] = []  # the embedding, each layer, the final norm, the LM head
    for name, child in model.named_children():
        units += [(f"{name}.{j}", m) for j, m in enumerate(child)] if isinstance(child, nn.ModuleList) else [(name, child)]
    for name, unit in units:
        unit.to_empty(device=device)
        fill_random(unit, seed, qwen3_5_draw, prefix=f"{name}.", index=index)
        if quantize is not None and not isinstance(unit, nn.Linear):  # a layer replaces its own linears
            quantize_qwen3_5(unit, *quantize)
    if quantize is not None:  # and the model its LM head
        quantize_qwen3_5(model, *quantize)
    model.materialize_buffers(device)  # computed, not random
    return model.eval()
