"""GPTQ and AWQ checkpoints (safetensors whose config.json has ``quantization_config.quant_method`` ``gptq`` or
``awq``) read as packed weights, without loss.

Each quantized linear ``X`` is stored as ``X.qweight`` (int32 words of 4- or 8-bit values), ``X.qzeros`` (the
zero points, packed alike) and ``X.scales`` (float16, one per group of ``group_size`` input features and output
feature): w = s (q - z). That is the affine layout onecopy already keeps packed (`q4a` for 4 bits, `q8a` for 8):
s q + m with m = -s z, and in float32 both products and their sum are exact (an fp16 scale has 11 significant bits,
q and z at most 8), so the repack is lossless. A symmetric weight (every z the midpoint, GPTQ's ``sym``) takes the
layouts without mins: `q4z`, s (q - 8), and `q8s`, s (q - 128) as int8 (the native CUDA kernels read both).
The result is the same `gguf_repack.PackedWeight` a GGUF repack gives, under the float weight's name
``X.weight``: the export keeps it packed (`quantize.pack_gguf`, fused q/k/v and gate/up included; a Qwen3.5 MoE's
per-expert linears stacked as its expert blocks), and the checkpoint's float32 dequantization stands in
``X.weight`` for the references.

The packings (AutoGPTQ / GPTQModel and transformers' GPTQ integration; AutoAWQ's GEMM kernel):
- GPTQ: qweight [K / p, N], p values a word along the input features (value j in bits b j ..); qzeros
  [K / group, N / p] along the output features; the classic format (``checkpoint_format`` ``gptq``) stores z - 1,
  ``gptq_v2`` stores z. ``desc_act`` (act-order) checkpoints give each input feature its group through ``g_idx``;
  where that is not ``k // group`` the groups are not runs of K, which no packed layout holds: such a weight is
  dequantized (exactly) and stays float, and the export says so.
- AWQ (``version`` ``gemm``): qweight [K, N / 8] and qzeros [K / group, N / 8], eight 4-bit values a word along the
  output features in the order 0, 2, 4, 6, 1, 3, 5, 7; w = s (q - z). The GEMV packing is refused with the fix.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from ..errors import ModelSourceError
from .gguf_repack import PackedWeight
from .packed import dequantize

log = logging.getLogger(__name__)

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word is output feature 8 c + _AWQ_ORDER[i]
_AWQ_UNDO = tuple(sorted(range(8), key=lambda i: _AWQ_ORDER[i]))  # the word's nibble that holds feature 8 c + j


def quant_method(quant: dict[str, Any]) -> str | None:
    """``gptq`` or ``awq`` for a checkpoint this module reads (``quantization_config``), else None."""
    method = str(quant.get("quant_method", "")).lower()
    return method if method in ("gptq", "awq") else None


def read_packed(sd: dict[str, torch.Tensor], quant: dict[str, Any]) -> dict[str, PackedWeight]:
    """Replace every GPTQ / AWQ linear of ``sd`` (HF names, as read from the shards) by its float32 dequantization
    ``X.weight`` (in place) and return the packed forms, ``X.weight`` -> `PackedWeight`. A checkpoint without
    ``.qweight`` tensors gives {}; one with them and another (or no) ``quant_method`` is refused."""
    names = sorted(k[:-len(".qweight")] for k in sd if k.endswith(".qweight"))
    method = quant_method(quant)
    if not names:
        return {}
    if method is None:
        raise ModelSourceError(f"the checkpoint holds packed weights ({names[0]}.qweight ...) but its config.json "
                               f"quantization_config.quant_method is {quant.get('quant_method')!r}; onecopy reads "
                               f"'gptq' and 'awq' ones")
    bits, group = int(quant.get("bits", 4)), int(quant.get("group_size", 128))
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm" or bits != 4:
            raise ModelSourceError(f"AWQ {version!r} packing with {bits} bits: onecopy reads AWQ's GEMM packing of "
                                   f"4-bit values (version 'gemm'); re-save the model with AutoAWQ's GEMM kernel")
    elif bits not in (4, 8):
        raise ModelSourceError(f"GPTQ with {bits} bits: onecopy keeps 4- and 8-bit values packed; re-quantize to "
                               f"4 or 8 bits, or export a float checkpoint")
    v1 = method == "gptq" and str(quant.get("checkpoint_format", "gptq")).lower() != "gptq_v2"
    packed = {}
    for name in names:
        parts = {p: sd.pop(f"{name}.{p}", None) for p in ("qweight", "qzeros", "scales", "g_idx")}
        if parts["qzeros"] is None or parts["scales"] is None:
            raise ModelSourceError(f"{name}.qweight comes without its {name}.qzeros and {name}.scales: the values "
                                   f"alone are not the weight; the checkpoint is incomplete")
        q, z, s = (_gptq_values if method == "gptq" else _awq_values)(parts, bits, name)
        if v1:
            z = z + 1  # the classic GPTQ format stores each zero point minus one
        n, k = q.shape
        if k % group or s.shape != (k // group, n) or z.shape != s.shape:
            raise ModelSourceError(f"{name}: scales {list(s.shape)} and zeros {list(z.shape)} are not one per "
                                   f"{group} input features of a [{n}, {k}] weight; check quantization_config.group_size")
        g_idx = parts["g_idx"]
        in_order = g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // group)
        sf, zf = s.float(), z.float()
        if not in_order:  # act-order: each input feature's own group; exact, but no packed layout holds it
            if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= k // group:
                raise ModelSourceError(f"{name}.g_idx must give each of the {k} input features a group below "
                                       f"{k // group}, got shape {list(g_idx.shape)}")
            gi = g_idx.long()
            sd[f"{name}.weight"] = sf[gi].t() * q.float() - (sf * zf)[gi].t()
            log.warning("%s: act-order GPTQ (desc_act) groups are not runs of K; kept float", name)
            continue
        scales = sf.t().contiguous()  # [N, K / group]
        qtype = f"{method.upper()} int{bits} g{group}"
        if bool((z == 1 << (bits - 1)).all()):  # symmetric (GPTQ sym): s (q - 8) is q4z, s (q - 128) is q8s
            values = (q[:, 0::2] | (q[:, 1::2] << 4)) if bits == 4 else (q.to(torch.int32) - 128).to(torch.int8)
            w = PackedWeight("q4z" if bits == 4 else "q8s", (n, k), group, values.contiguous(), scales, None, qtype)
        else:
            mins = (-(sf * zf)).t().contiguous()
            values = q if bits == 8 else (q[:, 0::2] | (q[:, 1::2] << 4))  # low nibble first
            w = PackedWeight("q4a" if bits == 4 else "q8a", (n, k), group, values.contiguous(), scales, mins, qtype)
        packed[f"{name}.weight"] = w
        sd[f"{name}.weight"] = dequantize(w.packed())  # float32, exact
    return packed


def _words(t: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., W] as their 32 / bits values [..., W, 32 / bits] (value j in bits bits * j ..), uint8."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((t.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


def _gptq_values(parts: dict[str, Any], bits: int, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's q [N, K], z [K / group, N] and s [K / group, N]."""
    qw, qz = parts["qweight"], parts["qzeros"]
    if qw.dtype != torch.int32 or qz.dtype != torch.int32 or qw.dim() != 2:
        raise ModelSourceError(f"{name}.qweight and .qzeros must be int32 matrices (GPTQ), got {qw.dtype} "
                               f"{list(qw.shape)}, {qz.dtype}")
    per = 32 // bits
    q = _words(qw.t(), bits).reshape(qw.shape[1], qw.shape[0] * per)  # [N, K]: input feature per * i + j
    z = _words(qz, bits).reshape(qz.shape[0], qz.shape[1] * per)
    return q, z.to(torch.int32), parts["scales"]


def _awq_values(parts: dict[str, Any], bits: int, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ's (GEMM packing) q [N, K], z [K / group, N] and s [K / group, N]."""
    qw, qz = parts["qweight"], parts["qzeros"]
    if qw.dtype != torch.int32 or qz.dtype != torch.int32 or qw.dim() != 2:
        raise ModelSourceError(f"{name}.qweight and .qzeros must be int32 matrices (AWQ), got {qw.dtype} "
                               f"{list(qw.shape)}, {qz.dtype}")
    undo = list(_AWQ_UNDO)
    q = _words(qw, bits)[..., undo].reshape(qw.shape[0], -1).t()  # [N, K]
    z = _words(qz, bits)[..., undo].reshape(qz.shape[0], -1)
    return q.contiguous(), z.to(torch.int32), parts["scales"]


_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def stack_experts(packed: dict[str, PackedWeight], num_experts: int) -> dict[str, PackedWeight]:
    """A Qwen3.5 MoE's per-expert linears (``...mlp.experts.J.{gate,up,down}_proj.weight``) as the expert blocks
    its model holds (``...mlp.experts.gate_up_proj`` [E, 2 I, H]: each expert's gate rows then its up rows, and
    ``...mlp.experts.down_proj`` [E, H, I]), where every expert of a layer came packed alike; the rest as given."""
    out = {k: v for k, v in packed.items() if not _EXPERT.match(k)}
    layers: dict[str, dict[tuple[int, str], PackedWeight]] = {}
    for k, v in packed.items():
        m = _EXPERT.match(k)
        if m:
            layers.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
    for prefix, parts in layers.items():
        for attr, kinds in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            ws = [parts.get((j, kind)) for j in range(num_experts) for kind in kinds]
            if any(w is None for w in ws) or len({(w.layout, w.group, w.shape[1]) for w in ws}) > 1:
                continue  # not every expert packed, or packed unlike: the float stack stays
            n, k = sum(w.shape[0] for w in ws[:len(kinds)]), ws[0].shape[1]
            cat = [torch.cat([getattr(w, part) for w in ws]) if ws[0].mins is not None or part != "mins" else None
                   for part in ("qweight", "scales", "mins")]
            out[f"{prefix}.{attr}"] = PackedWeight(ws[0].layout, (num_experts, n, k), ws[0].group, *cat,
                                                  qtype=ws[0].qtype)
    return out
