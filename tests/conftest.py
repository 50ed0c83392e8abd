"""Shared fixtures: every bundle is compiled once per test session."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

import onecopy
from onecopy.models.source import ModelSource, preset_source, resolve_source

TINY_MAX_SEQ_LEN = 64


@pytest.fixture(scope="session")
def tiny_source() -> ModelSource:
    return preset_source("tiny-llama")


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_source: ModelSource) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "tiny"
    return onecopy.export(tiny_source, out, max_seq_len=TINY_MAX_SEQ_LEN, progress=False)


@pytest.fixture(scope="session")
def tiny_rows_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_source: ModelSource) -> Path:
    """The KV cache as one row of max_seq_len positions per session (no paged KV, no prefix cache)."""
    out = tmp_path_factory.mktemp("bundles") / "tiny-rows"
    return onecopy.export(tiny_source, out, max_seq_len=TINY_MAX_SEQ_LEN, kv_block=None, progress=False)


@pytest.fixture(scope="session")
def fallback_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_source: ModelSource) -> Path:
    """prefill weightless, decode compiled the default way (carries its own weights)."""
    out = tmp_path_factory.mktemp("bundles") / "fallback"
    return onecopy.export(tiny_source, out, max_seq_len=TINY_MAX_SEQ_LEN, embed_weights=("decode",), progress=False)


@pytest.fixture
def tiny_engine(tiny_bundle: Path):
    with onecopy.Engine.load(tiny_bundle) as engine:
        yield engine


@pytest.fixture
def det_engine(tiny_bundle: Path):
    """Deterministic mode: every decode step at the full pool size, each session at its own row."""
    with onecopy.Engine.load(tiny_bundle, max_sessions=6, deterministic=True) as engine:
        yield engine


@pytest.fixture(scope="session")
def smollm2_source() -> ModelSource:
    return resolve_source("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_bundle(tmp_path_factory: pytest.TempPathFactory, smollm2_source: ModelSource) -> Path:
    out = tmp_path_factory.mktemp("bundles") / "smollm2"
    return onecopy.export(smollm2_source, out, max_seq_len=256, progress=False)


def copy_bundle(src: Path, dst: Path) -> Path:
    """A writable copy to damage (packages are symlinked: they are large and tests only read them)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_dir():
            shutil.copytree(f, dst / f.name)
        else:
            shutil.copy(f, dst / f.name)
    return dst


def eager_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from an eager onecopy Transformer (prefill, then one token at a time)."""
    out = []
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids)))
        pos = len(ids)
        for _ in range(n):
            t = int(logits.argmax(-1))
            out.append(t)
            logits = model(torch.tensor([[t]]), torch.tensor([pos]))
            pos += 1
    return out


def hf_greedy(source: ModelSource, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from transformers' LlamaForCausalLM on the same weights (full recompute each step)."""
    import transformers

    from onecopy.models.hf_checkpoint import hf_config_from_llama

    cfg = transformers.LlamaConfig(**hf_config_from_llama(source.config))
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(source.hf_state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.fixture(scope="session")
def whisper_source():
    return resolve_source("whisper-tiny.en")


@pytest.fixture(scope="session")
def whisper_bundle(tmp_path_factory: pytest.TempPathFactory, whisper_source) -> Path:
    return onecopy.export(whisper_source, tmp_path_factory.mktemp("bundles") / "whisper", progress=False)


SPOKEN = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="session")
def speech_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WAV of SPOKEN made by espeak-ng (22.05 kHz: the transcriber resamples it)."""
    import os
    import subprocess

    if shutil.which("espeak-ng") is None:
        if os.environ.get("CI") or os.environ.get("ONECOPY_REQUIRE_ESPEAK"):
            pytest.fail("espeak-ng is required here (apt-get install espeak-ng)")
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")
    out = tmp_path_factory.mktemp("audio") / "fox.wav"
    subprocess.run(["espeak-ng", "-w", str(out), SPOKEN], check=True)
    return out


class HostReads:
    """Counts every way a tensor's values are read into Python/host memory while active."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__index__", "__bool__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[str, int, torch.dtype, int]] = []
        for name in self.METHODS:
            real = getattr(torch.Tensor, name)

            def spy(t, *a, _real=real, _name=name, **k):
                self.reads.append((_name, t.numel(), t.dtype, t.data_ptr()))
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, spy)


def wait_until(pred, timeout: float = 10.0) -> bool:
    """Poll ``pred`` until true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
