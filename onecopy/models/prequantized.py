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
  [K / group, N / p] along the output features; the classic format (``checkpoint_format`` ``gptq``, or none)
  stores the zeros' word minus 0x11111111, ``gptq_v2`` the zeros; other packings (Marlin, ``gptq_p``) are refused.
  A group past 128 (``group_size`` -1: one a row) becomes groups of 128 with the same scale and min.
  ``desc_act`` (act-order) checkpoints give each input feature its group through ``g_idx``;
  where that is not ``k // group`` the groups are not runs of K, which no packed layout holds: such a weight is
  dequantized (exactly) and stays float, with a warning.
- AWQ (``version`` ``gemm``): qweight [K, N / 8] and qzeros [K / group, N / 8], eight 4-bit values a word along the
  output features in the order 0, 2, 4, 6, 1, 3, 5, 7; w = s (q - z). The GEMV packing is refused with the fix.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
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


def quantization_config(path: Path) -> dict[str, Any]:
    """A checkpoint directory's quantization settings: config.json's ``quantization_config`` (a multimodal config
    may nest it in its ``text_config``), else the files older tools wrote beside it: AutoGPTQ's
    quantize_config.json (no ``quant_method``: GPTQ), AutoAWQ's quant_config.json (``w_bit``, ``q_group_size``)."""
    raw = json.loads((path / "config.json").read_text())
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if quant:
        return dict(quant)
    if (path / "quantize_config.json").is_file():
        return {"quant_method": "gptq", **json.loads((path / "quantize_config.json").read_text())}
    if (path / "quant_config.json").is_file():
        q = json.loads((path / "quant_config.json").read_text())
        return {"quant_method": "awq", "bits": q.get("w_bit", 4), "group_size": q.get("q_group_size", 128),
                "version": q.get("version", "gemm"), "zero_point": q.get("zero_point", True)}
    return {}


def read_packed(sd: dict[str, torch.Tensor], quant: dict[str, Any]) -> dict[str, PackedWeight]:
    """Replace every GPTQ / AWQ linear of ``sd`` (HF names, as read from the shards) by its float32 dequantization
    ``X.weight`` (in place) and return the packed forms, ``X.weight`` -> `PackedWeight`. A checkpoint without
    ``.qweight`` tensors gives {}; one with them and another (or no) ``quant_method`` is refused. Each weight's bit
    width and group come from its tensors' shapes (GPTQModel's ``dynamic`` configs set them per module)."""
    names = sorted(k[:-len(".qweight")] for k in sd if k.endswith(".qweight"))
    if not names:
        return {}
    method = quant_method(quant)
    if method is None:
        raise ModelSourceError(f"the checkpoint holds packed weights ({names[0]}.qweight ...) but its config.json "
                               f"quantization_config.quant_method is {quant.get('quant_method')!r}; onecopy reads "
                               f"'gptq' and 'awq' ones")
    v1 = False
    if method == "gptq":
        fmt = str(quant.get("checkpoint_format") or quant.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2") or quant.get("is_marlin_format"):
            raise ModelSourceError(f"GPTQ checkpoint format {'marlin' if quant.get('is_marlin_format') else fmt!r}: "
                                   f"onecopy reads the 'gptq' and 'gptq_v2' packings; save the model in one of them "
                                   f"(GPTQModel: format='gptq')")
        v1 = fmt == "gptq"  # the classic format stores each zero point minus one
    else:
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelSourceError(f"AWQ {version!r} packing: onecopy reads AWQ's GEMM packing of 4-bit values "
                                   f"(version 'gemm'); re-save the model with AutoAWQ's GEMM kernel")
    # the layouts without mins where the tools quantized about the midpoint (GPTQ sym, AWQ without zero points):
    # then every weight of the checkpoint takes them, so fused projections and expert stacks pack alike
    sym = bool(quant.get("sym", True)) if method == "gptq" else not quant.get("zero_point", True)
    packed = {}
    for name in names:
        parts = {p: sd.pop(f"{name}.{p}", None) for p in ("qweight", "qzeros", "scales", "g_idx")}
        if parts["qzeros"] is None or parts["scales"] is None:
            if f"{name}.scaled_zeros" in sd:
                raise ModelSourceError(f"{name}: llm-awq's packing (scaled_zeros, no qzeros); onecopy reads "
                                       f"AutoAWQ's GEMM packing: re-save the model with AutoAWQ")
            raise ModelSourceError(f"{name}.qweight comes without its {name}.qzeros and {name}.scales: the values "
                                   f"alone are not the weight; the checkpoint is incomplete")
        bits, k, group = _widths(method, parts, name)
        bias = sd.get(f"{name}.bias")
        if bias is not None and not bool(bias.any()):
            del sd[f"{name}.bias"]  # AutoGPTQ up to 0.6 gave every linear a bias of zeros
        q, z, s = _gptq_values(parts, bits, v1) if method == "gptq" else _awq_values(parts, bits)
        n = q.shape[0]
        g_idx = parts["g_idx"]
        sf, zf = s.float(), z.float()
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
            # act-order: each input feature's own group; exact, but no packed layout holds it
            if g_idx.shape != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= k // group:
                raise ModelSourceError(f"{name}.g_idx must give each of the {k} input features a group below "
                                       f"{k // group}, got shape {list(g_idx.shape)}")
            gi = g_idx.long()
            sd[f"{name}.weight"] = sf[gi].t() * q.float() - (sf * zf)[gi].t()
            log.warning("%s: act-order GPTQ (desc_act) groups are not runs of K; kept float", name)
            continue
        # a group past the layouts' 128 (a whole row: group_size -1) as groups of 128 with the same scale and min
        rep = group // 128 if group > 128 and group % 128 == 0 else 1
        scales = sf.t().repeat_interleave(rep, 1).contiguous()  # [N, K / group]
        midpoint = sym and bool((z == 1 << (bits - 1)).all())  # s (q - 8) is q4z, s (q - 128) is q8s
        if bits == 4:
            values = q[:, 0::2] | (q[:, 1::2] << 4)  # low nibble first
        else:
            values = (q.to(torch.int32) - 128).to(torch.int8) if midpoint else q
        mins = None if midpoint else (-(sf * zf)).t().repeat_interleave(rep, 1).contiguous()
        layout = {(4, True): "q4z", (8, True): "q8s", (4, False): "q4a", (8, False): "q8a"}[bits, midpoint]
        w = PackedWeight(layout, (n, k), group // rep, values.contiguous(), scales, mins,
                         qtype=f"{method.upper()} int{bits} g{group}")
        packed[f"{name}.weight"] = w
        sd[f"{name}.weight"] = dequantize(w.packed())  # float32, exact
    return packed


def _widths(method: str, parts: dict[str, Any], name: str) -> tuple[int, int, int]:
    """A packed weight's (bits, K, group) from its tensors' shapes: GPTQ qweight [K b / 32, N], qzeros
    [K / group, N b / 32], scales [K / group, N]; AWQ qweight [K, N b / 32], qzeros and scales as GPTQ's."""
    qw, qz, s = parts["qweight"], parts["qzeros"], parts["scales"]
    if qw.dtype != torch.int32 or qz.dtype != torch.int32 or qw.dim() != 2 or qz.dim() != 2 or s.dim() != 2:
        raise ModelSourceError(f"{name}: qweight and qzeros must be int32 matrices and scales a matrix, got "
                               f"{qw.dtype} {list(qw.shape)}, {qz.dtype} {list(qz.shape)}, {list(s.shape)}")
    groups, n = s.shape
    bits = 32 * qz.shape[1] // n if n and qz.shape[0] == groups and (32 * qz.shape[1]) % n == 0 else 0
    if bits not in (4, 8) or (method == "awq" and bits != 4):
        raise ModelSourceError(f"{name}: {bits or 'an unknown number of'} bits a value ({method.upper()} qzeros "
                               f"{list(qz.shape)} for scales {list(s.shape)}); onecopy keeps 4-bit values packed "
                               f"(GPTQ also 8-bit): re-quantize to 4 or 8 bits, or export a float checkpoint")
    k = qw.shape[0] * (32 // bits) if method == "gptq" else qw.shape[0]
    wide = qw.shape[1] if method == "gptq" else qw.shape[1] * (32 // bits)
    if wide != n or k % groups or (parts["g_idx"] is not None and parts["g_idx"].numel() != k):
        raise ModelSourceError(f"{name}: qweight {list(qw.shape)}, qzeros {list(qz.shape)} and scales "
                               f"{list(s.shape)} are not one {bits}-bit {method.upper()} weight of {n} outputs "
                               f"in whole groups")
    return bits, k, k // groups


def _words(t: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., W] as their 32 / bits values [..., W, 32 / bits] (value j in bits bits * j ..), uint8."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((t.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


def _gptq_values(parts: dict[str, Any], bits: int, v1: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's q [N, K], z [K / group, N] and s [K / group, N]. The classic format (v1) stores each zero point
    minus one, written as the word minus 0x11111111 (4 bits) with its borrows (GPTQModel), so the word plus that
    constant, modulo 2^32, is the zeros' word (AutoGPTQ's per-value z - 1 gives the same word where no z is 0)."""
    qw, qz = parts["qweight"], parts["qzeros"]
    per = 32 // bits
    if v1:
        qz = (qz.to(torch.int64) + {4: 0x11111111, 8: 0x01010101}[bits]) & 0xFFFFFFFF
    q = _words(qw.t(), bits).reshape(qw.shape[1], qw.shape[0] * per)  # [N, K]: input feature per * i + j
    z = _words(qz, bits).reshape(qz.shape[0], qz.shape[1] * per)
    return q, z.to(torch.int32), parts["scales"]


def _awq_values(parts: dict[str, Any], bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ's (GEMM packing) q [N, K], z [K / group, N] and s [K / group, N]."""
    qw, qz = parts["qweight"], parts["qzeros"]
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
