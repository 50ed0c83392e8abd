"""The model families onecopy exports, in one registry: what `source` needs from each, by name and by
checkpoint ``model_type``, instead of if/elif chains.

A family is its module (``llama``, ``qwen3_5``, ``whisper``) and its checkpoint conversion
(``hf_checkpoint``, ``qwen3_5_convert``, ``ct2_whisper``). A new family adds an entry here; its
presets go in `presets`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from . import ct2_whisper, hf_checkpoint, qwen3_5_convert, random_weights
from .llama import Transformer
from .qwen3_5 import Qwen35
from .whisper import Whisper


@dataclass(frozen=True)
class Family:
    """One model family: ``name`` is its configs' ``family``, `source.ModelSource.family` and the bundle
    manifest's family."""

    name: str
    model: Callable[[Any, int, torch.dtype], nn.Module]  # model(config, max_seq_len, dtype): the eager module
    config_from_hf: Callable[[dict[str, Any]], Any]  # a config.json (or a GGUF file's equivalent) -> config
    hf_config: Callable[[Any], dict[str, Any]]  # config -> the config.json `ModelSource.save_hf` writes
    to_onecopy: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]  # HF names -> onecopy FQNs
    read_hf_dir: Callable[[Path], dict[str, Any]]  # a checkpoint directory -> `ModelSource` fields
    model_types: tuple[str, ...]  # the config.json model_type values this family reads
    random_weights: Callable[[Any, int], dict[str, torch.Tensor]] | None = None  # seeded, HF names (presets)
    # model(config, max_seq_len, dtype, device, seed) with seeded weights drawn on the device (large presets)
    random_on_device: Callable[..., nn.Module] | None = None


LLAMA = Family(
    "llama", Transformer, hf_checkpoint.llama_config_from_hf, hf_checkpoint.hf_config_from_llama,
    hf_checkpoint.hf_to_onecopy,
    functools.partial(hf_checkpoint.read_text_dir, read_checkpoint=hf_checkpoint.read_hf_checkpoint,
                      config_from_hf=hf_checkpoint.llama_config_from_hf),
    hf_checkpoint.SUPPORTED_MODEL_TYPES, random_weights.llama_hf_weights, random_weights.llama_on_device)


def _qwen3_5(name: str, model_types: tuple[str, ...]) -> Family:
    """Dense and MoE Qwen3.5 share their code; the config (``num_experts``) says which one a model is."""
    return Family(
        name, Qwen35, qwen3_5_convert.config_from_hf, qwen3_5_convert.hf_config_from_qwen3_5,
        qwen3_5_convert.hf_to_onecopy,
        functools.partial(hf_checkpoint.read_text_dir, read_checkpoint=qwen3_5_convert.read_checkpoint,
                          config_from_hf=qwen3_5_convert.config_from_hf),
        model_types, random_weights.qwen3_5_hf_weights, random_weights.qwen3_5_on_device)


QWEN3_5 = _qwen3_5("qwen3_5", ("qwen3_5", "qwen3_5_text"))
QWEN3_5_MOE = _qwen3_5("qwen3_5_moe", ("qwen3_5_moe", "qwen3_5_moe_text"))
WHISPER = Family("whisper", Whisper, ct2_whisper.whisper_config_from_hf, ct2_whisper.hf_config_from_whisper,
                 ct2_whisper.whisper_to_onecopy, ct2_whisper.read_hf_dir, ("whisper",))

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN3_5, QWEN3_5_MOE, WHISPER)}
_BY_MODEL_TYPE: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.model_types}


def family(name: str) -> Family:
    """The family called ``name`` (`ModelSource.family`)."""
    return FAMILIES[name]


def for_model_type(model_type: str | None) -> Family:
    """The family that reads a checkpoint whose config.json (or GGUF architecture) says ``model_type``.
    Anything unknown goes to the Llama loader, whose refusal names the types it supports."""
    return _BY_MODEL_TYPE.get(model_type, LLAMA)
