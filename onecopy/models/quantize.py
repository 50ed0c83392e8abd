"""Which weights of a model stay (or become) packed, at export: GGUF blocks repacked, or float weights quantized.

Two ways in, one result (`models.packed` layers in place of the float ones):
- a GGUF source keeps its quantized tensors (`gguf_repack` layouts, lossless) unless asked to dequantize;
- ``--quantize int8|int4`` quantizes a float model's projections round-to-nearest per group of K:
  int8 symmetric (q8s: s = max|w| / 127), int4 asymmetric (q4a: s = (max - min) / 15, m = min);
  ``--quantize fp8`` to float8 e4m3 with one scale per output feature (f8r: s = max|w| / 448; its
  group is the row, whatever ``group``), multiplied with FP8 activations (`packed.fp8_linear`).
What is packed: the Llama family's projections (wqkv, wo, w13, w2, the LM head) and, from GGUF, its embedding;
the Qwen3.5 family's projections (attention, DeltaNet's output, shared expert, the LM head) and its routed experts
(`packed.PackedExperts`, [E, N, K] stacks), not its routers nor DeltaNet's input projection (`KEPT_FLOAT`).
Norms, biases, convolutions and RoPE stay float. `packed_layers` is what the manifest records.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ExportError
from ..layouts import GROUPS, LAYOUTS
from .linear import PackedLinear
from .mma_order import orderable
from .packed import FP8_MAX, Packed, PackedEmbedding, PackedExperts, tile_ordered

QUANTIZE_MODES = {"int8": "q8s", "int4": "q4a", "fp8": "f8r"}  # --quantize -> layout
DEFAULT_GROUP = 128


def quantize_weight(w: torch.Tensor, mode: str, group: int = DEFAULT_GROUP) -> Packed:
    """Round-to-nearest quantization of a float weight [N, K] per ``group`` values along K (on its device)."""
    if mode not in QUANTIZE_MODES:
        raise ExportError(f"quantize={mode!r} is not supported; use {' or '.join(QUANTIZE_MODES)} (--quantize)")
    n, k = w.shape
    if mode == "fp8":
        if n % 16 or k % 16:  # torch._scaled_mm's CUDA kernels take no other shapes
            raise ExportError(f"quantize='fp8' needs a weight's inputs and outputs in multiples of 16, this one is "
                              f"[{n}, {k}]; use quantize='int8' (--quantize int8)")
        wf = w.detach().float()
        s = wf.abs().amax(-1, keepdim=True) / FP8_MAX
        q = (wf / torch.where(s > 0, s, 1.0)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return Packed("f8r", k, q, s.contiguous())
    if group not in GROUPS or k % group:
        raise ExportError(f"group size {group} does not divide a weight's {k} inputs or is not one of {GROUPS} "
                          "(--group-size)")
    g = w.detach().float().reshape(n, k // group, group)
    if mode == "int8":
        s = g.abs().amax(-1) / 127
        q = torch.round(g / torch.where(s > 0, s, 1.0)[..., None]).clamp(-127, 127).to(torch.int8)
        return Packed("q8s", group, q.reshape(n, k), s.contiguous())
    lo, hi = g.amin(-1), g.amax(-1)
    s = (hi - lo) / 15
    q = torch.round((g - lo[..., None]) / torch.where(s > 0, s, 1.0)[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(n, k)
    return Packed("q4a", group, (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), s.contiguous(), lo.contiguous())


def quantize_experts(w: torch.Tensor, mode: str, group: int = DEFAULT_GROUP) -> PackedExperts:
    """A float [E, N, K] stack of expert weights quantized as `quantize_weight` does each [N, K] (its rows are
    independent, so the stack quantizes as one [E * N, K] matrix)."""
    e, n, k = w.shape
    p = quantize_weight(w.reshape(e * n, k), mode, group)
    return PackedExperts(p.layout, p.group, p.qweight.reshape(e, n, -1), p.scales.reshape(e, n, -1),
                         None if p.mins is None else p.mins.reshape(e, n, -1))


# Qwen3.5 linears that stay float: the MoE routers (a token's top-k follows their logits closely) and DeltaNet's
# fused input projection, whose b and a rows set beta and the decay of the recurrent state (an error there compounds
# through the exponential decay over the sequence; Qwen3-Next's FP8 checkpoints keep them bf16 too)
KEPT_FLOAT = ("mlp.gate", "mlp.shared_expert_gate", "linear_attn.in_proj")


def _projections(model: nn.Module) -> list[str]:
    """The module names of a Llama-family model's projections, the LM head last."""
    names = [f"layers.{i}.{n}" for i in range(len(model.layers))
             for n in ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")]
    return names + (["output"] if hasattr(model, "output") else [])


def _replace(model: nn.Module, name: str, w: Packed) -> None:
    parent, _, attr = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    old = getattr(owner, attr)
    dev = next(iter(old.parameters())).device
    if dev.type != "meta":  # (a model built without memory: the packed tensors stay where they were read)
        w = w.rebuild(tuple(t.to(dev) for t in w.tensors()))
    if isinstance(old, nn.Embedding):
        setattr(owner, attr, PackedEmbedding(w, old.weight.dtype))
    else:
        setattr(owner, attr, PackedLinear(w, old.bias))


def _check_family(model: nn.Module, what: str, families: tuple[type, ...] = ()) -> None:
    from .llama import Transformer

    if not isinstance(model, (Transformer, *families)):
        names = " and ".join(["the Llama family", *(f"the {f.__module__.rsplit('.', 1)[-1]} family" for f in families)])
        raise ExportError(f"{what} is supported for {names} only; {type(model).__name__} models export "
                          "with float weights")


def quantize_model(model: nn.Module, mode: str, group: int = DEFAULT_GROUP) -> None:
    """Replace every projection of a Llama- or Qwen3.5-family ``model`` with its ``mode`` quantization, and a
    Qwen3.5 MoE's routed experts with packed stacks (in place). Layers already packed stay as they are (an
    on-device preset is quantized as it is drawn: `random_weights`)."""
    from .qwen3_5 import Qwen35

    _check_family(model, "--quantize", (Qwen35,))
    if isinstance(model, Qwen35):
        quantize_qwen3_5(model, mode, group)
        return
    for name in _projections(model):
        if not isinstance(model.get_submodule(name), PackedLinear):
            _replace(model, name, quantize_weight(model.get_submodule(name).weight, mode, group))


def quantize_qwen3_5(module: nn.Module, mode: str, group: int = DEFAULT_GROUP) -> None:
    """`quantize_model` for a Qwen3.5 model or any part of one (a layer: the on-device draw quantizes each as
    it is drawn): its float linears but `KEPT_FLOAT`, and its routed-expert stacks."""
    from .qwen3_5 import Experts

    linears = [name for name, m in module.named_modules() if isinstance(m, nn.Linear) and not name.endswith(KEPT_FLOAT)]
    for name in linears:
        _replace(module, name, quantize_weight(module.get_submodule(name).weight, mode, group))
    for m in module.modules():
        if isinstance(m, Experts):
            for attr in ("gate_up_proj", "down_proj"):
                if isinstance(getattr(m, attr), PackedExperts):
                    continue
                packed = quantize_experts(getattr(m, attr).data, mode, group)
                delattr(m, attr)  # a parameter's name cannot take a module
                setattr(m, attr, packed)


# onecopy module -> the HF tensors it fuses (layer i), for a GGUF source's packed tensors
_GGUF_PARTS = {
    "attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attention.wo": ("self_attn.o_proj",), "feed_forward.w13": ("mlp.gate_proj", "mlp.up_proj"),
    "feed_forward.w2": ("mlp.down_proj",),
}


# Qwen3.5: onecopy module -> the HF tensors it fuses (layer i; a layer of the other kind or MLP has none of them)
_GGUF_PARTS_QWEN3_5 = {
    "self_attn.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn.wo": ("self_attn.o_proj",),
    "linear_attn.out_proj": ("linear_attn.out_proj",), "mlp.w13": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.w2": ("mlp.down_proj",), "mlp.shared_expert.w13": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    "mlp.shared_expert.w2": ("mlp.shared_expert.down_proj",),
}


def pack_gguf(model: nn.Module, packed: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """Replace the layers of a Llama- or Qwen3.5-family ``model`` whose GGUF tensors (``packed``: HF name ->
    `gguf_repack.PackedWeight`) stayed quantized (Qwen3.5: its routed-expert stacks too). Returns (layer -> its
    GGUF type(s), the layers kept float): a fused layer whose parts differ in layout or group (a Q4_K_M
    file's Q6_K v next to Q4_K q and k) keeps the float weight it was built with (the export says so); so do, in
    a Qwen3.5 model, expert stacks and DeltaNet output projections the file did not give packed (gate and up of
    different types; value-head blocks that are not whole scale groups: `gguf_qwen3_5`)."""
    from .qwen3_5 import Qwen35

    _check_family(model, "packed GGUF weights", (Qwen35,))
    if isinstance(model, Qwen35):
        plan = {f"layers.{i}.{m}": [f"model.layers.{i}.{p}.weight" for p in parts]
                for i in range(len(model.layers)) for m, parts in _GGUF_PARTS_QWEN3_5.items()}
        if not model.config.tie_embeddings:  # a tied table is the LM head's weight too: it stays float
            plan["lm_head"] = ["lm_head.weight"]
        sources = _pack_gguf_experts(model, packed)
    else:
        plan = {f"layers.{i}.{m}": [f"model.layers.{i}.{p}.weight" for p in parts]
                for i in range(len(model.layers)) for m, parts in _GGUF_PARTS.items()}
        plan["tok_embeddings"] = ["model.embed_tokens.weight"]
        if hasattr(model, "output"):
            plan["output"] = ["lm_head.weight"]
        sources = {}
    kept_float = []
    for name, parts in plan.items():
        ws = [packed.get(p) for p in parts]
        if any(w is None for w in ws):
            continue  # a float (or unsupported) GGUF type: the float weight stays
        if len({(w.layout, w.group) for w in ws}) > 1:
            kept_float.append(name)
            continue
        cat = [torch.cat([getattr(w, part) for w in ws]) if getattr(ws[0], part) is not None else None
               for part in ("qweight", "scales", "mins")]
        _replace(model, name, Packed(ws[0].layout, ws[0].group, *cat))
        sources[name] = "+".join(dict.fromkeys(w.qtype for w in ws))
    if isinstance(model, Qwen35):
        kept_float += [n for n, m in model.named_modules() if n.endswith("linear_attn.out_proj")
                       and not isinstance(m, PackedLinear)]
        kept_float += [f"{n}.{a}" for n, m in model.named_modules() if n.endswith("mlp.experts")
                       for a in ("gate_up_proj", "down_proj") if not isinstance(getattr(m, a), PackedExperts)]
    return sources, kept_float


def _pack_gguf_experts(model: nn.Module, packed: dict[str, Any]) -> dict[str, str]:
    """A Qwen3.5 MoE's routed-expert stacks that a GGUF holds quantized, as `packed.PackedExperts` (in place)."""
    sources = {}
    for i, layer in enumerate(model.layers):
        experts = getattr(layer.mlp, "experts", None)
        for attr in ("gate_up_proj", "down_proj") if experts is not None else ():
            w = packed.get(f"model.layers.{i}.mlp.experts.{attr}")
            if w is None:
                continue
            e, n, _ = w.shape
            dev = getattr(experts, attr).device
            parts = [None if t is None else t.reshape(e, n, -1).to(t.device if dev.type == "meta" else dev)
                     for t in (w.qweight, w.scales, w.mins)]
            delattr(experts, attr)  # a parameter's name cannot take a module
            setattr(experts, attr, PackedExperts(w.layout, w.group, *parts))
            sources[f"layers.{i}.mlp.experts.{attr}"] = w.qtype
    return sources


def order_tiles(model: nn.Module) -> list[str]:
    """Rewrite every packed projection of ``model`` that has a tile order (`mma_order.orderable`) in it, in
    place (the ``_mma`` layouts the native CUDA decode kernel reads; an export for CUDA does this). Embedding
    tables keep their order (their rows are gathered, not multiplied). Returns the layers rewritten."""
    done = []
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear) and orderable(m.layout, m.group, m.weight.shape):
            w = tile_ordered(m.weight)
            m.layout, m.qweight, m.scales, m.mins = w.layout, w.qweight, w.scales, w.mins
            done.append(name)
    return done


def packed_layers(model: nn.Module, source: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """What the manifest records per packed layer: layout, group, float shape ([N, K]; [E, N, K] for a stack of
    experts) and where it came from (``source``: layer -> a GGUF type or the quantization mode)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (PackedLinear, PackedEmbedding, PackedExperts)):
            shape = m.shape if isinstance(m, PackedExperts) else m.weight.shape
            out[name] = {"layout": m.layout, "group": m.group, "shape": list(shape), "source": (source or {}).get(name, "")}
    return out


assert set(QUANTIZE_MODES.values()) <= set(LAYOUTS)
