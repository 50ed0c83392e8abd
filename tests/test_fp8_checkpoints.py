"""FP8 block-scaled checkpoints (Qwen's and DeepSeek's FP8 releases: float8 e4m3 weights, a float32
``weight_scale_inv`` per block of ``quantization_config.weight_block_size``) read as their dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from onecopy.errors import ModelSourceError
from onecopy.models.source import preset_source, resolve_source

BLOCK = (32, 16)


def _fp8_checkpoint(tmp_path, preset: str, drop_scale: str | None = None):
    """The preset saved as an HF checkpoint whose projections (2-D, and a MoE's 3-D expert stacks) are FP8 with
    block scales; each block scaled by its own power of two first, so that a scale put on the wrong block shows.
    Returns the directory and the weights each FP8 tensor must read back as (bf16, built block by block)."""
    src = preset_source(preset)
    d = tmp_path / "hf"
    src.save_hf(d)
    sd = load_file(str(d / "model.safetensors"))
    want = {}
    bn, bk = BLOCK
    for name in [k for k, w in sd.items() if k.endswith(("proj.weight", "gate_up_proj", "down_proj"))]:
        w = sd[name].float().clone()
        n, k = w.shape[-2:]
        rows, cols = -(-n // bn), -(-k // bk)
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        s = torch.empty(*w.shape[:-2], rows, cols)
        expected = torch.empty(w.shape)
        for i in range(rows):
            for j in range(cols):
                blk = w[..., i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] * 2.0 ** ((3 * i + j) % 7 - 3)
                amax = blk.abs().amax(dim=(-1, -2), keepdim=True).clamp_min(1e-12)
                qb = (blk * 448 / amax).to(torch.float8_e4m3fn)
                q[..., i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qb
                s[..., i, j] = (amax / 448)[..., 0, 0]
                expected[..., i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qb.float() * (amax / 448)
        sd[name], want[name] = q, expected.to(torch.bfloat16)
        if name != drop_scale:
            sd[name + "_scale_inv"] = s
    save_file(sd, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (d / "config.json").write_text(json.dumps(cfg))
    return d, want


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3.5-moe"])
def test_an_fp8_block_scaled_checkpoint_reads_as_its_dequantized_weights(preset, tmp_path):
    d, want = _fp8_checkpoint(tmp_path, preset)
    src = resolve_source(d)
    assert want and not any(k.endswith("_scale_inv") for k in src.hf_state_dict)
    for name, w in want.items():
        assert src.hf_state_dict[name].dtype == torch.bfloat16 and torch.equal(src.hf_state_dict[name], w), name
    src.build(64, torch.float32)  # the weights fit the model


def test_an_fp8_weight_without_its_scales_is_refused(tmp_path):
    d, _ = _fp8_checkpoint(tmp_path, "tiny-llama", drop_scale="model.layers.0.mlp.down_proj.weight")
    with pytest.raises(ModelSourceError, match=r"model\.layers\.0\.mlp\.down_proj\.weight is float8 without its "
                                               r"model\.layers\.0\.mlp\.down_proj\.weight_scale_inv"):
        resolve_source(d)
