"""The embedded default model: built once into a cache directory, reused afterwards."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from .bundle import FORMAT_VERSION, read_manifest
from .errors import BundleError
from .models.source import EMBEDDED_DEFAULT, EMBEDDED_WHISPER

DEFAULT_MAX_SEQ_LEN = 2048
WHISPER_MAX_SEQ_LEN = 448  # Whisper's decoder positions


def cache_dir() -> Path:
    """$ONECOPY_CACHE, else $XDG_CACHE_HOME/onecopy, else ~/.cache/onecopy."""
    if os.environ.get("ONECOPY_CACHE"):
        return Path(os.environ["ONECOPY_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "onecopy"


def default_bundle(device: str = "cpu", progress: bool = True, model: str = EMBEDDED_DEFAULT) -> Path:
    """Path of a model's bundle for ``device`` in the cache, exporting it on first use.

    ``model`` is any export source: the embedded names, a preset, a .gguf file or a checkpoint dir
    (a path is keyed by its absolute location). A build says so first, on stderr with ``progress`` (then
    the export's bar), else at INFO in the log (`export.exporter.progress_note`).
    """
    from .export.exporter import export, progress_note

    max_seq_len = WHISPER_MAX_SEQ_LEN if model == EMBEDDED_WHISPER else DEFAULT_MAX_SEQ_LEN
    torch_tag = torch.__version__.split("+")[0]
    name = str(model)
    if os.sep in name or Path(name).exists():
        where = str(Path(name).expanduser().resolve())
        name = f"{Path(where).name}-{hashlib.sha1(where.encode()).hexdigest()[:8]}"
    path = cache_dir() / f"{name}-{device}-msl{max_seq_len}-torch{torch_tag}-v{FORMAT_VERSION}"
    try:
        methods = read_manifest(path).methods.values()
        if device != "cuda" or any(m.batch_invariant for m in methods if m.role == "decode"):
            return path  # else a CUDA bundle built before the batch-invariant decode: build it again
    except BundleError:
        pass  # absent or damaged: (re)build it
    path.parent.mkdir(parents=True, exist_ok=True)
    progress_note(f"building the bundle of {model} into {path}; this happens once", progress)
    return export(model, path, max_seq_len=max_seq_len, device=device, overwrite=True, progress=progress)
