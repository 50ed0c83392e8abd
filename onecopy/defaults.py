"""The embedded default model: built once into a cache directory, reused afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .bundle import FORMAT_VERSION, read_manifest
from .errors import BundleError
from .models.source import EMBEDDED_DEFAULT

DEFAULT_MAX_SEQ_LEN = 2048


def cache_dir() -> Path:
    """$ONECOPY_CACHE, else $XDG_CACHE_HOME/onecopy, else ~/.cache/onecopy."""
    if os.environ.get("ONECOPY_CACHE"):
        return Path(os.environ["ONECOPY_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "onecopy"


def default_bundle(device: str = "cpu", progress: bool = True) -> Path:
    """Path of the embedded default bundle for ``device``, exporting it on first use."""
    from .export.exporter import export

    torch_tag = torch.__version__.split("+")[0]
    path = cache_dir() / f"{EMBEDDED_DEFAULT}-{device}-msl{DEFAULT_MAX_SEQ_LEN}-torch{torch_tag}-v{FORMAT_VERSION}"
    try:
        read_manifest(path)
        return path
    except BundleError:
        pass  # absent or damaged: (re)build it
    path.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"building the embedded default bundle ({EMBEDDED_DEFAULT}) into {path}; this happens once")
    return export(EMBEDDED_DEFAULT, path, max_seq_len=DEFAULT_MAX_SEQ_LEN, device=device, overwrite=True,
                  progress=progress)
