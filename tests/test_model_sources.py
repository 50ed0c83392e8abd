"""Model definitions and loaders against transformers' own implementations (eager, no compile)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from onecopy.errors import ModelSourceError
from onecopy.models.hf_checkpoint import llama_config_from_hf, read_hf_checkpoint
from onecopy.models.presets import random_hf_state_dict
from onecopy.models.source import ModelSource, byte_tokenizer_json, resolve_source

IDS = [3, 17, 99, 250, 4, 77, 12]


def _hf_config(model_type, **extra):
    base = {"model_type": model_type, "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "head_dim": 16,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
            "tie_word_embeddings": False}
    base.update(extra)
    return base


def _reference(hf_cfg, sd):
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[hf_cfg["model_type"]]
    cfg = cls[0](**{k: v for k, v in hf_cfg.items() if k != "model_type"})
    cfg._attn_implementation = "eager"
    model = cls[1](cfg).eval()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[:, -1]


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("llama", {"tie_word_embeddings": True}),
    ("qwen2", {}),
    ("qwen3", {}),
])
def test_eager_model_matches_transformers(model_type, extra):
    hf_cfg = _hf_config(model_type, **extra)
    cfg = llama_config_from_hf(hf_cfg)
    assert cfg.qkv_bias == (model_type == "qwen2") and cfg.qk_norm == (model_type == "qwen3")
    sd = random_hf_state_dict(cfg, seed=7)
    src = ModelSource(name="t", config=cfg, hf_state_dict=sd, tokenizer_json=byte_tokenizer_json(300), eos_token_ids=[299])
    model = src.build(32, torch.float32)
    with torch.no_grad():
        ours = model(torch.tensor([IDS]), torch.arange(len(IDS)))
    torch.testing.assert_close(ours, _reference(hf_cfg, sd), rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_dir(tmp_path, tiny_source):
    sd = tiny_source.hf_state_dict
    names = sorted(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, keys in shards.items():
        save_file({k: sd[k].contiguous() for k in keys}, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    tiny_source.save_hf(tmp_path / "unused")  # writes config.json + tokenizer.json we reuse
    for f in ("config.json", "tokenizer.json"):
        (tmp_path / f).write_text((tmp_path / "unused" / f).read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    src = resolve_source(tmp_path)
    assert src.eos_token_ids == [5, 6]
    _, loaded = read_hf_checkpoint(tmp_path)
    assert set(loaded) == set(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)


def test_gguf_embedded_default_config(smollm2_source):
    c = smollm2_source.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.tie_embeddings) == (30, 576, 9, 3, True)
    assert smollm2_source.eos_token_ids == [2] and "<|im_start|>" in smollm2_source.chat_template


@pytest.mark.parametrize("source,match", [
    ("no-such-preset", "is not a preset"),
])
def test_unknown_source(source, match):
    with pytest.raises(ModelSourceError, match=match):
        resolve_source(source)


def test_bad_checkpoints(tmp_path):
    with pytest.raises(ModelSourceError, match="no config.json"):
        read_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_hf_config("gpt2")))
    with pytest.raises(ModelSourceError, match="'gpt2' is not supported"):
        resolve_source(tmp_path)
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF garbage")
    with pytest.raises(ModelSourceError, match="not a readable GGUF"):
        resolve_source(bad)


def test_checkpoint_tensors_must_match_the_architecture():
    """A checkpoint that lacks a tensor the config needs, or holds one nothing maps (a deeper model
    read with a shallower config), is refused by name, for both families."""
    from onecopy.models import qwen3_5_convert
    from onecopy.models.hf_checkpoint import hf_to_onecopy
    from onecopy.models.presets import PRESETS

    cfg = llama_config_from_hf(_hf_config("llama"))
    sd = random_hf_state_dict(cfg, seed=1)
    with pytest.raises(ModelSourceError, match=r"lacks tensor 'model.layers.1.mlp.down_proj.weight'; is this a "
                                               r"2-layer Llama-family model\?"):
        hf_to_onecopy({k: v for k, v in sd.items() if k != "model.layers.1.mlp.down_proj.weight"}, cfg)
    with pytest.raises(ModelSourceError, match=r"does not map: \['model.layers.2.input_layernorm.weight'\]"):
        hf_to_onecopy({**sd, "model.layers.2.input_layernorm.weight": torch.ones(64)}, cfg)
    qcfg = PRESETS["tiny-qwen3.5-moe"].config
    qsd = random_hf_state_dict(qcfg, seed=1)
    assert set(qwen3_5_convert.hf_to_onecopy(qsd, qcfg)) >= {"layers.0.mlp.experts.gate_up_proj"}
    with pytest.raises(ModelSourceError, match=r"lacks tensor 'model.norm.weight'; is this a \d+-layer Qwen3.5 "):
        qwen3_5_convert.hf_to_onecopy({k: v for k, v in qsd.items() if k != "model.norm.weight"}, qcfg)
    with pytest.raises(ModelSourceError, match=r"does not map: \['model.extra.weight'\]"):
        qwen3_5_convert.hf_to_onecopy({**qsd, "model.extra.weight": torch.ones(1)}, qcfg)
