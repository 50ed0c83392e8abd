"""GPTQ and AWQ checkpoints (models/prequantized.py): their int4 / int8 linears come packed, bit for bit the
checkpoint's own dequantization, and run like the float model; what no packed layout holds stays float or is
refused with the fix. The checkpoints are written here by the reference packers' loops (AutoGPTQ's
QuantLinear.pack, AutoAWQ's WQLinear_GEMM), not by inverting the reader."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from onecopy.errors import ModelSourceError
from onecopy.models.linear import PackedLinear
from onecopy.models.packed import PackedExperts, dequantize
from onecopy.models.quantize import pack_gguf
from onecopy.models.source import ModelSource, preset_source, resolve_source

from .conftest import TINY_MAX_SEQ_LEN

PROMPT = [7, 3, 99, 250, 18, 42, 5, 300, 11]
GROUP = 32
LLAMA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj")


def _rtn(w: torch.Tensor, bits: int, group: int, sym: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest of w [N, K], asymmetric or (``sym``) about the midpoint zero: integer q [N, K], zeros z
    [K / group, N], fp16 scales [K / group, N] (as GPTQ and AWQ store them), w ~ s (q - z)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    top = (1 << bits) - 1
    if sym:
        s = (torch.maximum(-lo, hi) / ((1 << (bits - 1)) - 1)).clamp(min=1e-5).half()
        z = torch.full_like(lo, 1 << (bits - 1))
    else:
        s = ((hi - lo) / top).clamp(min=1e-5).half()
        z = torch.round(-lo / s.float()).clamp(0, top)
    q = torch.round(g / s.float().unsqueeze(-1) + z.unsqueeze(-1)).clamp(0, top).reshape(n, k)
    return q.long(), z.t().long().contiguous(), s.t().contiguous()


def _gptq_tensors(w: torch.Tensor, bits: int, group: int, v2: bool, sym: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ's pack: qweight [K / p, N] (p values a word along K), qzeros [K / group, N / p], fp16 scales, g_idx;
    the classic format's zeros word minus 0x11..11 with its borrows, as GPTQModel writes it (AutoGPTQ's per-value
    z - 1 is the same word where no zero point is 0)."""
    q, z, s = _rtn(w, bits, group, sym)
    per, (n, k) = 32 // bits, w.shape
    intweight = q.t().contiguous()  # [K, N]
    qweight = torch.zeros(k // per, n, dtype=torch.int64)
    for row in range(k // per):
        for j in range(per):
            qweight[row] |= intweight[row * per + j] << (bits * j)
    qzeros = torch.zeros(k // group, n // per, dtype=torch.int64)
    for col in range(n // per):
        for j in range(per):
            qzeros[:, col] |= z[:, col * per + j] << (bits * j)
    if not v2:
        qzeros = (qzeros - {4: 0x11111111, 8: 0x01010101}[bits]) % (1 << 32)
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": s,
            "g_idx": (torch.arange(k) // group).to(torch.int32)}


def _awq_tensors(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM pack: qweight [K, N / 8] and qzeros [K / group, N / 8], the word's nibbles in the order
    0, 2, 4, 6, 1, 3, 5, 7."""
    q, z, s = _rtn(w, 4, group)
    intweight, order = q.t().contiguous(), (0, 2, 4, 6, 1, 3, 5, 7)
    k, n = intweight.shape
    qweight = torch.zeros(k, n // 8, dtype=torch.int64)
    qzeros = torch.zeros(k // group, n // 8, dtype=torch.int64)
    for col in range(n // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + order[i]] << (i * 4)
            qzeros[:, col] |= z[:, col * 8 + order[i]] << (i * 4)
    return {"qweight": _int32(qweight), "qzeros": _int32(qzeros), "scales": s}


def _int32(t: torch.Tensor) -> torch.Tensor:
    """Words of 32 bits (packed as unsigned) as the int32 the checkpoints store."""
    return torch.where(t < (1 << 31), t, t - (1 << 32)).to(torch.int32)


def _reference(w: torch.Tensor, bits: int, group: int, sym: bool = False) -> torch.Tensor:
    """The checkpoint's weight as its format defines it: s (q - z), in float64 (exact in float32 too)."""
    q, z, s = _rtn(w, bits, group, sym)
    return (s.double().t().repeat_interleave(group, 1) * (q - z.t().repeat_interleave(group, 1)).double()).float()


def _write(src: ModelSource, path: Path, linears: dict[str, torch.Tensor], quant: dict,
           config_file: str = "config.json") -> dict[str, torch.Tensor]:
    """``src`` saved as a checkpoint dir whose ``linears`` (HF name without .weight -> float weight) are quantized
    per ``quant`` (in config.json's quantization_config, or as the whole of ``config_file``); returns their
    reference values."""
    src.save_hf(path)
    sd = {k: v for k, v in src.hf_state_dict.items() if k[:-len(".weight")] not in linears}
    refs = {}
    for name, w in linears.items():
        bits, sym = quant.get("bits", quant.get("w_bit", 4)), bool(quant.get("sym"))
        group = quant.get("group_size", quant.get("q_group_size", GROUP))
        group = w.shape[1] if group == -1 else group
        t = _awq_tensors(w, group) if quant.get("quant_method") == "awq" or "w_bit" in quant else _gptq_tensors(
            w, bits, group, quant.get("checkpoint_format") == "gptq_v2", sym)
        sd.update({f"{name}.{part}": v for part, v in t.items()})
        refs[f"{name}.weight"] = _reference(w, bits, group, sym)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    if config_file == "config.json":
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    else:  # the older tools' own file beside config.json
        (path / config_file).write_text(json.dumps(quant))
    return refs


def _llama_linears(src: ModelSource) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.{p}": src.hf_state_dict[f"model.layers.{i}.{p}.weight"]
            for i in range(src.config.n_layers) for p in LLAMA_LINEARS}


@pytest.mark.parametrize("quant, config_file", [
    ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False}, "config.json"),
    ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "checkpoint_format": "gptq_v2"}, "config.json"),
    ({"quant_method": "gptq", "bits": 8, "group_size": GROUP}, "config.json"),
    ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True}, "config.json"),
    ({"quant_method": "gptq", "bits": 8, "group_size": GROUP, "sym": True}, "config.json"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": False}, "config.json"),
    ({"bits": 4, "group_size": GROUP, "desc_act": False, "sym": False}, "quantize_config.json"),
    ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm", "zero_point": True}, "config.json"),
    ({"zero_point": True, "q_group_size": GROUP, "w_bit": 4, "version": "GEMM"}, "quant_config.json"),
], ids=["gptq", "gptq_v2", "gptq-int8", "gptq-sym", "gptq-int8-sym", "gptq-per-row", "autogptq-0.6-file", "awq",
        "autoawq-file"])
def test_gptq_and_awq_linears_load_packed_bit_for_bit_and_run_like_the_float_model(tmp_path, quant, config_file):
    """Every packing and format, each weight's values exactly the checkpoint's s (q - z): asymmetric zero points
    of 0 too (layer 0's q projection holds no negative weight), a per-row group (group_size -1) as groups of the
    layouts, the zero biases AutoGPTQ up to 0.6 wrote dropped, the settings from config.json or the file older
    tools wrote beside it."""
    tiny = preset_source("tiny-llama")
    linears = _llama_linears(tiny)
    linears["model.layers.0.self_attn.q_proj"] = linears["model.layers.0.self_attn.q_proj"].abs()  # zero points 0
    refs = _write(tiny, tmp_path / "ckpt", linears, quant, config_file)
    sd = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    sd.update({f"{n}.bias": torch.zeros(w.shape[0]) for n, w in linears.items()})  # AutoGPTQ <= 0.6's zero biases
    save_file(sd, str(tmp_path / "ckpt" / "model.safetensors"))
    src = resolve_source(tmp_path / "ckpt")
    awq = quant.get("quant_method") == "awq" or "w_bit" in quant
    bits, group = quant.get("bits", 4), quant.get("group_size", GROUP)
    layout = {(4, False): "q4a", (8, False): "q8a", (4, True): "q4z", (8, True): "q8s"}[bits, bool(quant.get("sym"))]
    assert set(src.packed) == set(refs)
    for name, ref in refs.items():
        p = src.packed[name]  # a symmetric checkpoint (every zero the midpoint) in the layouts without mins
        k = ref.shape[1]
        assert (p.layout, p.group, p.qtype) == (layout, k if group == -1 else group,
                                                f"{'AWQ' if awq else 'GPTQ'} int{bits} g{k if group == -1 else group}")
        assert torch.equal(dequantize(p.packed()), ref), name  # the format's s (q - z), exactly
        assert torch.equal(src.hf_state_dict[name], ref), name  # the references' float weights
    float_model = src.build(TINY_MAX_SEQ_LEN, torch.float32)
    packed_model = src.build(TINY_MAX_SEQ_LEN, torch.float32)
    sources, kept_float = pack_gguf(packed_model, src.packed)
    assert kept_float == [] and set(sources) == {f"layers.{i}.{m}" for i in range(2) for m in (
        "attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")}
    assert isinstance(packed_model.layers[0].attention.wqkv, PackedLinear)
    with torch.no_grad():  # the same float32 values, summed in the CPU kernel's order
        ids = torch.tensor([PROMPT])
        got, ref = packed_model(ids, torch.arange(len(PROMPT))), float_model(ids, torch.arange(len(PROMPT)))
    assert torch.allclose(got, ref, rtol=0, atol=1e-4 * ref.abs().max().item()), (got - ref).abs().max()


def test_act_order_gptq_weights_are_dequantized_exactly_and_stay_float(tmp_path):
    """desc_act: an input feature's group comes from g_idx, not from its position; no packed layout holds that, so
    the weight is the checkpoint's exact dequantization, kept float (the rest stays packed)."""
    tiny = preset_source("tiny-llama")
    quant = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True}
    path = tmp_path / "ckpt"
    _write(tiny, path, _llama_linears(tiny), quant)
    sd = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    k = sd[f"{name}.qweight"].shape[0] * 8
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(0))
    sd[f"{name}.g_idx"] = (perm // GROUP).to(torch.int32)  # input feature i is in group perm[i] // GROUP
    save_file(sd, str(path / "model.safetensors"))
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # the suite runs with pytest's logging plugin off (no caplog)
    logger = logging.getLogger("onecopy.models.prequantized")
    logger.addHandler(handler)
    try:
        src = resolve_source(path)
    finally:
        logger.removeHandler(handler)
    assert f"{name}.weight" not in src.packed and len(src.packed) == 2 * len(LLAMA_LINEARS) - 1
    assert [r.getMessage() for r in records] == [f"{name}: act-order GPTQ (desc_act) groups are not runs of K; kept float"]
    q = torch.stack([(sd[f"{name}.qweight"].t().to(torch.int64) >> (4 * j)) & 15 for j in range(8)], -1)
    q = q.reshape(q.shape[0], k).double()  # [N, K]
    words = (sd[f"{name}.qzeros"].to(torch.int64) + 0x11111111) % (1 << 32)  # the classic format's zeros word
    z = torch.stack([(words >> (4 * j)) & 15 for j in range(8)], -1)
    z = z.reshape(z.shape[0], -1).double()  # [K / group, N]
    s, g = sd[f"{name}.scales"].double(), (perm // GROUP)
    want = (s[g].t() * (q - z[g].t())).float()
    assert torch.equal(src.hf_state_dict[f"{name}.weight"], want)
    sources, kept_float = pack_gguf(src.build(TINY_MAX_SEQ_LEN, torch.float32), src.packed)
    assert "layers.1.feed_forward.w2" not in sources and "layers.0.feed_forward.w2" in sources


GPTQ4 = {"quant_method": "gptq", "bits": 4, "group_size": GROUP}


@pytest.mark.parametrize("quant, tamper, match", [
    ({**GPTQ4, "quant_method": "awq", "version": "gemv"}, None,
     r"AWQ 'gemv' packing: onecopy reads AWQ's GEMM packing of 4-bit values \(version 'gemm'\); re-save the model "
     r"with AutoAWQ's GEMM kernel"),
    ({**GPTQ4, "checkpoint_format": "gptq_p"}, None,
     r"GPTQ checkpoint format 'gptq_p': onecopy reads the 'gptq' and 'gptq_v2' packings; save the model in one of "
     r"them \(GPTQModel: format='gptq'\)"),
    ({**GPTQ4, "is_marlin_format": True}, None, r"GPTQ checkpoint format 'marlin': onecopy reads the 'gptq'"),
    (GPTQ4, "three_bits",
     r"model.layers.0.mlp.down_proj: 3 bits a value \(GPTQ qzeros \[4, 6\] for scales \[4, 64\]\); onecopy keeps "
     r"4-bit values packed \(GPTQ also 8-bit\): re-quantize to 4 or 8 bits, or export a float checkpoint"),
    (GPTQ4, "drop_zeros",
     r"model.layers.0.self_attn.q_proj.qweight comes without its .*qzeros and .*scales: .* incomplete"),
    (GPTQ4, "llm_awq", r"model.layers.0.self_attn.q_proj: llm-awq's packing \(scaled_zeros, no qzeros\); onecopy "
     r"reads AutoAWQ's GEMM packing: re-save the model with AutoAWQ"),
    ({**GPTQ4, "quant_method": "bitsandbytes"}, None,
     r"holds packed weights \(model.layers.0.mlp.down_proj.qweight ...\) but its config.json "
     r"quantization_config.quant_method is 'bitsandbytes'; onecopy reads 'gptq' and 'awq' ones"),
    (GPTQ4, "short_scales",
     r"model.layers.0.mlp.down_proj: qweight \[16, 64\], qzeros \[3, 8\] and scales \[3, 64\] are not one 4-bit "
     r"GPTQ weight of 64 outputs in whole groups"),
], ids=["awq-gemv", "gptq_p", "marlin", "three-bits", "no-zeros", "llm-awq", "other-method", "short-scales"])
def test_a_prequantized_checkpoint_onecopy_cannot_keep_is_refused_with_the_fix(tmp_path, quant, tamper, match):
    tiny = preset_source("tiny-llama")
    path = tmp_path / "ckpt"
    _write(tiny, path, _llama_linears(tiny), GPTQ4 if quant["quant_method"] != "awq" else {**quant, "version": "gemm"})
    sd = load_file(str(path / "model.safetensors"))
    if tamper == "three_bits":  # qzeros [K / group, N 3 / 32]: 3 bits a value
        sd["model.layers.0.mlp.down_proj.qzeros"] = torch.zeros(4, 6, dtype=torch.int32)
    elif tamper in ("drop_zeros", "llm_awq"):
        del sd["model.layers.0.self_attn.q_proj.qzeros"]
        if tamper == "llm_awq":
            sd["model.layers.0.self_attn.q_proj.scaled_zeros"] = torch.zeros(2, 64, dtype=torch.float16)
    elif tamper == "short_scales":  # a group short: 3 scale rows for 128 input features
        for part in ("qzeros", "scales"):
            sd[f"model.layers.0.mlp.down_proj.{part}"] = sd[f"model.layers.0.mlp.down_proj.{part}"][:3].contiguous()
    save_file(sd, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    with pytest.raises(ModelSourceError, match=match):
        resolve_source(path)


def test_gptq_experts_of_a_qwen3_5_moe_are_stacked_packed_and_run_like_the_float_model(tmp_path):
    """Per-expert GPTQ linears (``mlp.experts.J.{gate,up,down}_proj``) become the packed expert blocks the model
    holds ([E, 2I, H] gate then up rows an expert, [E, H, I]), the shared expert's packed too, from a checkpoint
    laid out as GPTQModel saves a multimodal Qwen3.5 (model.language_model.*, quantization_config in text_config)."""
    moe = preset_source("tiny-qwen3.5-moe")
    cfg, sd = moe.config, dict(moe.hf_state_dict)
    linears = {}
    for i in range(cfg.n_layers):
        m = f"model.layers.{i}.mlp."
        gate_up, down = sd.pop(m + "experts.gate_up_proj"), sd.pop(m + "experts.down_proj")
        hid = gate_up.shape[1] // 2
        for j in range(cfg.num_experts):
            for part, w in (("gate", gate_up[j, :hid]), ("up", gate_up[j, hid:]), ("down", down[j])):
                sd[f"{m}experts.{j}.{part}_proj.weight"] = w.contiguous()
                linears[f"{m}experts.{j}.{part}_proj"] = w
        for part in ("gate", "up", "down"):
            linears[f"{m}shared_expert.{part}_proj"] = sd[f"{m}shared_expert.{part}_proj.weight"]
    # named as GPTQModel saves a multimodal Qwen3.5: the text model under model.language_model
    mm = {k.replace("model.", "model.language_model.", 1): v for k, v in sd.items()}
    linears = {k.replace("model.", "model.language_model.", 1): v for k, v in linears.items()}
    per_expert = ModelSource(moe.name, cfg, mm, moe.tokenizer_json, moe.eos_token_ids, family=moe.family)
    _write(per_expert, tmp_path / "ckpt", linears, {"quant_method": "gptq", "bits": 4, "group_size": GROUP})
    # as a multimodal Qwen3.5 config.json holds it: the text model's config, quantization_config with it, nested
    text = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text}))
    src = resolve_source(tmp_path / "ckpt")
    e, hid = cfg.num_experts, cfg.moe_intermediate_size
    stack = src.packed["model.layers.0.mlp.experts.gate_up_proj"]
    assert stack.shape == (e, 2 * hid, cfg.dim) and stack.layout == "q4a"
    assert not any(".experts.0." in k for k in src.packed)
    # expert 1's up rows, as stacked, are that expert's checkpoint values
    w = dequantize(stack.packed()).reshape(e, 2 * hid, cfg.dim)
    assert torch.equal(w[1, hid:], _reference(linears["model.language_model.layers.0.mlp.experts.1.up_proj"], 4, GROUP))
    float_model = src.build(TINY_MAX_SEQ_LEN, torch.float32)
    packed_model = src.build(TINY_MAX_SEQ_LEN, torch.float32)
    sources, _ = pack_gguf(packed_model, src.packed)
    assert isinstance(packed_model.layers[0].mlp.experts.gate_up_proj, PackedExperts)
    assert sources["layers.0.mlp.experts.gate_up_proj"] == "GPTQ int4 g32" and "layers.0.mlp.shared_expert.w13" in sources
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        got, ref = packed_model(ids, torch.arange(len(PROMPT))), float_model(ids, torch.arange(len(PROMPT)))
    assert torch.allclose(got, ref, rtol=0, atol=1e-4 * ref.abs().max().item()), (got - ref).abs().max()
