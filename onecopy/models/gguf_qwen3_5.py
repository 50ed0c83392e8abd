"""Qwen3.5 GGUF files (llama.cpp's ``qwen35`` and ``qwen35moe`` architectures) to transformers' names and values.

llama.cpp's converter (conversion/qwen.py: ``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel`` over ``Qwen3NextModel``;
read at commit 0c1e5709) changes the checkpoint on the way; this module undoes each change:
- every RMSNorm weight but DeltaNet's output norm is stored as 1 + w (Qwen3.5's norms compute x (1 + w));
- ``A_log`` is stored as ``ssm_a`` = -exp(A_log), ``dt_bias`` as ``ssm_dt.bias``, the conv1d weight squeezed
  to [channels, kernel];
- DeltaNet's value heads are permuted from transformers' grouped order (value head j reads key head j // r) to
  llama.cpp's tiled one (slot i nk + g holds value head g r + i), wherever they index a dimension: the value
  rows of ``attn_qkv`` and the conv channels, ``attn_gate``, ``ssm_beta``, ``ssm_alpha``, ``ssm_a``,
  ``ssm_dt``, the columns of ``ssm_out`` (only when key and value heads differ in number; no metadata marks it);
- the routed experts are 3-D stacks ``ffn_{gate,up,down}_exps`` [E, rows, columns] (or a fused
  ``ffn_gate_up_exps``), the shared expert's gate a [1, D] matrix.
The gated attention's q_proj (query and gate interleaved per head) is stored as it is, without llama's
RoPE row permutation. A multi-token-prediction block (``blk.{n_layer}``, ``nextn.*``) is skipped. Values come
back in float32: exact but for the 1 + w round trip (error <= 6e-8 for |w| < 2^-16) and exp / log (an ulp).
Quantized tensors of the types `gguf_repack` takes are also kept repacked (``packed``, by transformers name, for
`quantize.pack_gguf`) where the converter moved no value inside them: the attention and expert projections, the
shared expert, the LM head, and DeltaNet's output projection when its value-head blocks are whole scale groups
(the layers the packing replaces; DeltaNet's input projection and the routers stay float anyway).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ..errors import ModelSourceError
from ..layouts import LAYOUTS
from .gguf_repack import PackedWeight

ARCHS = ("qwen35", "qwen35moe")

_COMMON = {"attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight"}
_LINEAR = {"attn_qkv.weight": "in_proj_qkv.weight", "attn_gate.weight": "in_proj_z.weight",
           "ssm_beta.weight": "in_proj_b.weight", "ssm_alpha.weight": "in_proj_a.weight",
           "ssm_conv1d.weight": "conv1d.weight", "ssm_dt.bias": "dt_bias", "ssm_a": "A_log",
           "ssm_norm.weight": "norm.weight", "ssm_out.weight": "out_proj.weight"}
_ATTENTION = {f"attn_{g}.{p}": f"{h}_proj.{p}" for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
              for p in ("weight", "bias")}
_ATTENTION.update({"attn_q_norm.weight": "q_norm.weight", "attn_k_norm.weight": "k_norm.weight"})
_MOE = {"ffn_gate_inp.weight": "gate.weight", "ffn_gate_inp_shexp.weight": "shared_expert_gate.weight",
        "ffn_gate_shexp.weight": "shared_expert.gate_proj.weight", "ffn_up_shexp.weight": "shared_expert.up_proj.weight",
        "ffn_down_shexp.weight": "shared_expert.down_proj.weight", "ffn_down_exps.weight": "experts.down_proj",
        "ffn_gate_up_exps.weight": "experts.gate_up_proj"}
_DENSE = {"ffn_gate.weight": "gate_proj.weight", "ffn_up.weight": "up_proj.weight", "ffn_down.weight": "down_proj.weight"}
# quantized matrices the converter stores as they are (packable as read; the expert gate / up stacks are joined)
_AS_STORED = {"token_embd.weight", "output.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
              "attn_output.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight",
              "ffn_down_exps.weight", "ffn_gate_up_exps.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
_PLUS_ONE = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight")


def _decimal(v: float) -> float:
    """The shortest decimal that rounds to the float32 the GGUF stores (1e-06, not 9.999999974752427e-07): the
    number the converter was given."""
    return float(np.format_float_positional(np.float32(v), unique=True, trim="-")) if v else 0.0


def hf_config(arch: str, field: Callable[[str, Any], Any], tensor_names: set[str], vocab: int) -> dict[str, Any]:
    """The transformers text config (``qwen3_5_text`` / ``qwen3_5_moe_text``) of a GGUF's metadata; ``field(key,
    default)`` reads ``{arch}.key``. ModelSourceError naming the keys a file lacks."""
    needed = ["block_count", "embedding_length", "attention.head_count", "attention.head_count_kv", "ssm.state_size",
              "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size"]
    needed += (["expert_count", "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length"]
               if arch == "qwen35moe" else ["feed_forward_length"])
    missing = [f"{arch}.{k}" for k in needed if field(k, None) is None]
    if missing:
        raise ModelSourceError(f"the {arch} GGUF lacks {', '.join(missing)}; it was not written by llama.cpp's "
                               "converter (or by an older one): reconvert it")
    n_layers = field("block_count", None) - (field("nextn_predict_layers", 0) or 0)
    nv = field("ssm.time_step_rank", None)
    head_dim = field("attention.key_length", None) or field("embedding_length", None) // field("attention.head_count", None)
    recurrent = field("attention.recurrent_layers", None)
    if recurrent is not None:
        layer_types = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:n_layers]]
    else:  # llama.cpp's default: every full_attention_interval-th layer is attention
        interval = field("full_attention_interval", 4) or 4
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    c: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text" if arch == "qwen35moe" else "qwen3_5_text",
        "vocab_size": int(field("vocab_size", None) or vocab), "hidden_size": field("embedding_length", None),
        "num_hidden_layers": n_layers, "num_attention_heads": field("attention.head_count", None),
        "num_key_value_heads": field("attention.head_count_kv", None), "head_dim": head_dim,
        "rms_norm_eps": _decimal(field("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": field("context_length", 32768),
        "rope_parameters": {"rope_type": "default", "rope_theta": _decimal(field("rope.freq_base", 10000.0)),
                            "partial_rotary_factor": (field("rope.dimension_count", None) or head_dim // 4) / head_dim},
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": any(n.endswith("attn_q.bias") for n in tensor_names),
        "layer_types": layer_types, "linear_conv_kernel_dim": field("ssm.conv_kernel", 4),
        "linear_key_head_dim": field("ssm.state_size", None), "linear_num_key_heads": field("ssm.group_count", None),
        "linear_num_value_heads": nv, "linear_value_head_dim": field("ssm.inner_size", None) // nv,
    }
    if arch == "qwen35moe":
        c.update(num_experts=field("expert_count", None), num_experts_per_tok=field("expert_used_count", None),
                 moe_intermediate_size=field("expert_feed_forward_length", None),
                 shared_expert_intermediate_size=field("expert_shared_feed_forward_length", None))
    else:
        c["intermediate_size"] = field("feed_forward_length", None)
    return c


def _v_heads(t: torch.Tensor, dim: int, groups: int, per_group: int, head_dim: int) -> torch.Tensor:
    """llama.cpp's ``_reorder_v_heads``: along ``dim``, [groups, per_group, head_dim] becomes
    [per_group, groups, head_dim]. (groups, per_group) = (nk, r) tiles transformers' order, (r, nk) undoes it."""
    shape = list(t.shape)
    split = shape[:dim] + [groups, per_group, head_dim] + shape[dim + 1:]
    return t.reshape(split).transpose(dim, dim + 1).contiguous().reshape(shape)


class Qwen35Tensors:
    """Maps each GGUF tensor of a ``qwen35`` / ``qwen35moe`` file to its transformers name and value (`add`), the
    expert stacks joined as transformers' fused ``experts.gate_up_proj`` (`finish`)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.n_layers = config["num_hidden_layers"]
        self.nk, self.nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
        self.key_dim = self.nk * config["linear_key_head_dim"]
        self.dv = config["linear_value_head_dim"]
        self.sd: dict[str, torch.Tensor] = {}
        self.packed: dict[str, PackedWeight] = {}
        self._experts: dict[int, dict[str, torch.Tensor]] = {}
        self._packed_experts: dict[int, dict[str, PackedWeight]] = {}

    def _untile(self, t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
        if self.nk == self.nv:
            return t
        return _v_heads(t, dim, self.nv // self.nk, self.nk, head_dim)

    def add(self, name: str, w: torch.Tensor, packed: PackedWeight | None = None) -> str | None:
        """Record one GGUF tensor (float32, transformers' shape order) and, if it is quantized, its repacked form;
        its transformers name, or None if skipped."""
        hf = self._add(name, w)
        if packed is None or hf is None:
            return hf
        kind = name.split(".", 2)[2] if name.startswith("blk.") else name
        if kind in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            self._packed_experts.setdefault(int(name.split(".")[1]), {})[kind.split("_")[1]] = packed
        elif kind == "ssm_out.weight":
            untiled = self._untile_packed(packed)
            if untiled is not None:
                self.packed[hf] = untiled
        elif kind in _AS_STORED:
            self.packed[hf] = packed
        return hf

    def _untile_packed(self, p: PackedWeight) -> PackedWeight | None:
        """``ssm_out`` packed with its value-head column blocks put back, or None if a block is not whole groups."""
        if self.nk == self.nv:
            return p
        if self.dv % p.group or self.dv % LAYOUTS[p.layout][0]:
            return None
        r = self.nv // self.nk
        parts = [None if t is None else _v_heads(t, 1, r, self.nk, t.shape[1] // self.nv)
                 for t in (p.qweight, p.scales, p.mins)]
        return PackedWeight(p.layout, p.shape, p.group, parts[0], parts[1], parts[2], p.qtype)

    def _add(self, name: str, w: torch.Tensor) -> str | None:
        top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
        if name in top:
            self.sd[top[name]] = w - 1 if name == "output_norm.weight" else w
            return top[name]
        parts = name.split(".", 2)
        if parts[0] == "nextn" or (parts[0] == "blk" and int(parts[1]) >= self.n_layers):
            return None  # the multi-token-prediction block: onecopy does not run it
        if parts[0] != "blk":
            raise ModelSourceError(f"GGUF tensor {name} is not understood; unsupported {self.config['model_type']} variant")
        i, kind = int(parts[1]), parts[2]
        linear = self.config["layer_types"][i] == "linear_attention"
        p = f"model.layers.{i}."
        if kind in _COMMON:
            hf = p + _COMMON[kind]
        elif linear and kind in _LINEAR:
            hf, w = p + "linear_attn." + _LINEAR[kind], self._linear(kind, w)
        elif not linear and kind in _ATTENTION:
            hf = p + "self_attn." + _ATTENTION[kind]
        elif kind in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            self._experts.setdefault(i, {})[kind.split("_")[1]] = w
            return p + "mlp.experts.gate_up_proj"
        elif kind in _MOE and "num_experts" in self.config:
            hf = p + "mlp." + _MOE[kind]
            if kind == "ffn_gate_inp_shexp.weight":
                w = w.reshape(1, -1)
        elif kind in _DENSE and "num_experts" not in self.config:
            hf = p + "mlp." + _DENSE[kind]
        else:
            raise ModelSourceError(f"GGUF tensor {name} is not understood for a "
                                   f"{'DeltaNet' if linear else 'attention'} layer of {self.config['model_type']}")
        self.sd[hf] = w - 1 if kind in _PLUS_ONE else w
        return hf

    def _linear(self, kind: str, w: torch.Tensor) -> torch.Tensor:
        if kind in ("attn_qkv.weight", "ssm_conv1d.weight"):  # [q; k; v] rows (conv: channels)
            w = torch.cat([w[:2 * self.key_dim], self._untile(w[2 * self.key_dim:], 0, self.dv)])
            return w.unsqueeze(1) if kind == "ssm_conv1d.weight" else w
        if kind == "attn_gate.weight":
            return self._untile(w, 0, self.dv)
        if kind in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias"):
            return self._untile(w, 0, 1)
        if kind == "ssm_a":
            return self._untile(torch.log(-w), 0, 1)
        if kind == "ssm_out.weight":
            return self._untile(w, 1, self.dv)
        return w  # ssm_norm: stored as it is

    def finish(self) -> dict[str, torch.Tensor]:
        """The state dict, every layer's gate and up expert stacks joined (gate rows first, as transformers)."""
        for i, parts in self._experts.items():
            if set(parts) != {"gate", "up"}:
                raise ModelSourceError(f"layer {i} of the GGUF has ffn_{'/'.join(parts)}_exps alone; both gate and "
                                       "up expert stacks are needed")
            self.sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat([parts["gate"], parts["up"]], dim=1)
        for i, pp in self._packed_experts.items():  # both stacks packed alike: joined per expert, gate rows first
            g, u = pp.get("gate"), pp.get("up")
            if g is None or u is None or (g.layout, g.group) != (u.layout, u.group):
                continue
            e, f, k = g.shape
            parts = [None if a is None else torch.cat([a.reshape(e, f, -1), b.reshape(e, f, -1)], 1).reshape(2 * e * f, -1)
                     for a, b in ((g.qweight, u.qweight), (g.scales, u.scales), (g.mins, u.mins))]
            qtype = g.qtype if g.qtype == u.qtype else f"{g.qtype}+{u.qtype}"
            self.packed[f"model.layers.{i}.mlp.experts.gate_up_proj"] = PackedWeight(g.layout, (e, 2 * f, k), g.group,
                                                                                   parts[0], parts[1], parts[2], qtype)
        self._experts, self._packed_experts = {}, {}
        return self.sd
