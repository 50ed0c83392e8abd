"""Qwen3.5 GGUF files (llama.cpp's ``qwen35`` / ``qwen35moe``): written by a mirror of llama.cpp's converter
(tests/gguf_writer.py), read back by `models.gguf_qwen3_5` into the very checkpoint and model they came from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from onecopy.errors import ModelSourceError
from onecopy.models.source import preset_source, resolve_source

from .gguf_writer import write_qwen35_gguf

PROMPT = [3, 17, 250, 9, 41, 77, 5, 300, 128]


def _source(preset: str, **changes):
    """A tiny preset with 2 key and 6 value heads (llama.cpp's tiling of 3 value heads a key head is not its own
    inverse, as 2 a head of 2 would be), other config ``changes``, and seeded weights for that shape."""
    from dataclasses import replace

    from onecopy.models.presets import random_hf_state_dict

    base = preset_source(preset)
    cfg = replace(base.config, linear_n_v_heads=6, **changes)
    return replace(base, config=cfg, hf_state_dict=random_hf_state_dict(cfg, 1))


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_a_float_gguf_reads_back_the_checkpoint_and_the_model(preset, tmp_path):
    """F32 tensors: every transformers tensor back under its name (1 + w norms, -exp(A_log), the value heads tiled
    by llama.cpp for 2 key / 6 value heads, the conv squeezed, the expert stacks joined as gate_up_proj), the same
    config (its layer pattern from ``attention.recurrent_layers``), and the eager model's logits."""
    src = _source(preset)
    loaded = resolve_source(write_qwen35_gguf(tmp_path / "m.gguf", src))
    assert loaded.family == src.family
    assert {**loaded.config.to_dict(), "linear_chunk_size": 0} == {**src.config.to_dict(), "linear_chunk_size": 0}
    assert loaded.hf_state_dict.keys() == src.hf_state_dict.keys()
    for name, want in src.hf_state_dict.items():
        torch.testing.assert_close(loaded.hf_state_dict[name], want.float(), atol=1e-6, rtol=1e-6, msg=name)
    with torch.no_grad():
        ref = src.build(64, torch.float32)(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
        got = loaded.build(64, torch.float32)(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_a_quantized_gguf_dequantizes_and_skips_the_mtp_block(tmp_path):
    """Q8_0 matrices (the norms, conv, routers and 1-D tensors stay F32, as the converter keeps them) come back
    within Q8_0's rounding of the checkpoint, the F32 ones exactly; the multi-token-prediction block that newer
    converters write after the layers (``nextn_predict_layers``) is left out."""
    src = _source("tiny-qwen3.5-moe")
    loaded = resolve_source(write_qwen35_gguf(tmp_path / "m.gguf", src, qtype=Q.Q8_0, mtp=True))
    assert loaded.config.n_layers == src.config.n_layers and loaded.hf_state_dict.keys() == src.hf_state_dict.keys()
    for name, want in src.hf_state_dict.items():
        got, want = loaded.hf_state_dict[name], want.float()
        quantized = want.dim() >= 2 and "conv1d" not in name and not name.endswith(("mlp.gate.weight", "expert_gate.weight"))
        bound = float(want.abs().max()) / 200 if quantized else 1e-6  # Q8_0: half a step of max|block| / 127
        assert float((got - want).abs().max()) <= bound, name
        if quantized:
            assert not torch.equal(got, want), name  # it was quantized


def test_an_unknown_tensor_is_named_in_the_error(tmp_path):
    src = preset_source("tiny-qwen3.5-moe")
    path = write_qwen35_gguf(tmp_path / "m.gguf", src, extra=(("blk.0.attn_q.weight", np.zeros((64, 64), np.float32)),))
    with pytest.raises(ModelSourceError, match=r"GGUF tensor blk\.0\.attn_q\.weight is not understood for a DeltaNet "
                                               r"layer of qwen3_5_moe_text"):
        resolve_source(path)


def test_quantized_matrices_stay_packed_and_compute_as_their_floats(tmp_path):
    """Q4_1 matrices: the attention and shared-expert projections, the LM head and each MoE layer's routed-expert
    stacks (gate and up joined per expert) keep their GGUF values packed (q4a, group 32), DeltaNet's output
    projection stays float where its value-head blocks (16 values here) are not whole groups, DeltaNet's input
    projection and the routers stay float as ever; the packed model's logits are the float model's on the same
    dequantized values (to the CPU kernel's summation order)."""
    import copy

    from onecopy.models.linear import PackedLinear
    from onecopy.models.packed import PackedExperts
    from onecopy.models.quantize import pack_gguf, packed_layers

    src = resolve_source(write_qwen35_gguf(tmp_path / "m.gguf", _source("tiny-qwen3.5-moe"), qtype=Q.Q4_1))
    float_model = src.build(64, torch.float32)
    model = copy.deepcopy(float_model)
    sources, kept_float = pack_gguf(model, src.packed)
    assert kept_float == ["layers.0.linear_attn.out_proj", "layers.2.linear_attn.out_proj"]  # reported, not silent
    assert isinstance(model.layers[1].self_attn.wqkv, PackedLinear) and isinstance(model.layers[1].self_attn.wo, PackedLinear)
    assert isinstance(model.layers[0].mlp.shared_expert.w13, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    for i in range(4):
        for attr in ("gate_up_proj", "down_proj"):
            w = getattr(model.layers[i].mlp.experts, attr)
            assert isinstance(w, PackedExperts) and (w.layout, w.group) == ("q4a", 32), (i, attr)
            assert sources[f"layers.{i}.mlp.experts.{attr}"] == "Q4_1"
    assert not isinstance(model.layers[0].linear_attn.out_proj, PackedLinear)  # dv 16 < group 32
    assert not isinstance(model.layers[0].linear_attn.in_proj, PackedLinear)
    assert packed_layers(model, sources)["layers.0.mlp.experts.gate_up_proj"]["shape"] == [4, 64, 64]
    with torch.no_grad():
        want = float_model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
        got = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_deltanet_output_projection_stays_packed_with_its_value_heads_put_back(tmp_path):
    """Value heads of 32 (whole Q8_0 groups): ``ssm_out``'s tiled column blocks are put back in the packed values
    and scales themselves, and the packed model computes as the float one."""
    import copy

    from onecopy.models.linear import PackedLinear
    from onecopy.models.quantize import pack_gguf

    base = _source("tiny-qwen3.5", linear_k_head_dim=32, linear_v_head_dim=32)
    src = resolve_source(write_qwen35_gguf(tmp_path / "m.gguf", base, qtype=Q.Q8_0))
    float_model = src.build(64, torch.float32)
    model = copy.deepcopy(float_model)
    pack_gguf(model, src.packed)
    assert isinstance(model.layers[0].linear_attn.out_proj, PackedLinear)
    with torch.no_grad():
        want = float_model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
        got = model(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_file_without_the_architecture_metadata_is_refused_naming_the_keys(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "qwen35moe")
    w.add_block_count(4)
    w.add_embedding_length(64)
    w.add_token_list(["a", "b"])
    w.add_eos_token_id(1)
    w.add_tensor("token_embd.weight", np.zeros((2, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelSourceError, match=r"the qwen35moe GGUF lacks qwen35moe\.attention\.head_count, .*"
                                               r"qwen35moe\.expert_count, .*reconvert it"):
        resolve_source(tmp_path / "bare.gguf")


def test_expert_stacks_that_stay_packed_are_read_without_their_floats(tmp_path):
    """`resolve_source(..., lazy_experts=True)` (what an export that keeps a GGUF packed reads): the routed-expert
    stacks come without float32 copies (meta: shape only; the 35B model's would be ~136 GB), and the model built from
    it (on the meta device, floats assigned, the GGUF layers packed) is the float-read model packed by `pack_gguf`:
    the same parameters and buffers bit for bit, the same logits, the same packing report."""
    import copy

    from onecopy.models.packed import PackedExperts
    from onecopy.models.quantize import pack_gguf

    path = write_qwen35_gguf(tmp_path / "m.gguf", _source("tiny-qwen3.5-moe"), qtype=Q.Q4_1)
    full, lazy = resolve_source(path), resolve_source(path, lazy_experts=True)
    experts = [k for k in full.hf_state_dict if ".mlp.experts." in k]
    assert len(experts) == 8 and all(lazy.hf_state_dict[k].is_meta for k in experts)
    assert not any(w.is_meta for k, w in lazy.hf_state_dict.items() if k not in experts)
    want = copy.deepcopy(full.build(64, torch.float32))
    report = pack_gguf(want, full.packed)
    got = lazy.build(64, torch.float32)
    assert got.gguf_packing == report
    from onecopy.export.exporter import _pack

    assert _pack(got, lazy, False, None, 128, False) == report[0]  # the export takes the packing as built
    assert isinstance(got.layers[0].mlp.experts.gate_up_proj, PackedExperts)
    w_state, g_state = want.state_dict(), got.state_dict()
    assert w_state.keys() == g_state.keys()
    for k in w_state:
        assert w_state[k].dtype == g_state[k].dtype and torch.equal(w_state[k], g_state[k]), k
    with torch.no_grad():
        torch.testing.assert_close(got(torch.tensor([PROMPT]), torch.arange(len(PROMPT))),
                                   want(torch.tensor([PROMPT]), torch.arange(len(PROMPT))), atol=0, rtol=0)
