"""One on-disk cache of the bundles the tests export: `cached_bundle(source, **export_options)`.

A bundle is exported once and reused by every test, module and later test run whose export would produce
the same bundle. Its key (`bundle_key`) is everything that shapes the exported files:

* the export options, bound to `onecopy.export`'s signature with its defaults (so ``max_seq_len=64`` and
  ``max_seq_len=64, kv_block=16`` are one bundle);
* the source: a preset or embedded model's name (and the embedded model's file contents), a .gguf file's or
  checkpoint directory's name and contents, or a `ModelSource`'s every field and tensor;
* the code that shapes a bundle: every file under onecopy/models, onecopy/export and onecopy/kernels, and
  every onecopy module the exporter imports (read from its import statements, so a module that moves is
  followed; the runtime, which only loads bundles, is not among them);
* torch's version and the other libraries the exporter writes with (safetensors, tokenizers, gguf, numpy);
* the compiler the exporter picks (its path and version) and the Python version;
* the CPU ISA Inductor generates code for, as in effect (ATen's CPU capability, which $ATEN_CPU_CAPABILITY caps,
  and the vector ISA Inductor picks), and the environment that moves the generated code otherwise
  (TORCHINDUCTOR_*, CXX). Not the variables that only choose MKL's or oneDNN's kernels when a bundle runs: CI's
  AVX2 rerun exports its own bundles on a machine with more than AVX2 and reuses the main run's on an AVX2 one
  (the same code either way).

Where: $ONECOPY_TEST_CACHE, else $XDG_CACHE_HOME/onecopy-tests, else ~/.cache/onecopy-tests (shared by clones
and worktrees on one machine: the key keeps apart what differs). ONECOPY_TEST_CACHE=off exports into a
temporary directory of this process instead (nothing reused across runs; a test run's bundles still exported
once).

Each entry is exported into a temporary directory beside the cache's entries and renamed into place when
complete, under a lock per key (a second pytest process waits for the first's export instead of repeating
it; a crashed export leaves only a temporary directory, removed later). Entries are read-only and
fingerprinted (every file's size and mtime): a damaged entry is never handed out (it is exported again), and
`check_entries_used` tells at the end of the run whether a test wrote into one (tests that damage a bundle
must damage a `conftest.copy_bundle` copy). Entries unused for a while go when the cache grows past
$ONECOPY_TEST_CACHE_MAX_GB (default 20), least recently used first.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

import onecopy
from onecopy.export.compile_worker import CompileWorkers
from onecopy.models.source import EMBEDDED_DEFAULT, EMBEDDED_WHISPER, ModelSource, embedded_default_gguf, embedded_whisper_dir
from onecopy.models.presets import PRESETS

ENV_DIR = "ONECOPY_TEST_CACHE"
ENV_MAX_GB = "ONECOPY_TEST_CACHE_MAX_GB"
# Environment variables that move the generated code besides the ISA in effect (keyed as it is: `environment`).
CODE_ENV = ("CXX", "AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL")
# TORCHINDUCTOR_* variables that only say where Inductor keeps its caches or how many processes compile.
INDUCTOR_ENV_IGNORED = {"TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS"}
# Directories and files whose every file shapes a bundle (on top of the exporter's imports).
SHAPING = ("models", "export", "kernels", "bundle.py")
LIBRARIES = ("torch", "safetensors", "tokenizers", "gguf", "numpy")
BUNDLE_DIR = "bundle"
ENTRY_FILE = "entry.json"
KEEP_UNUSED_S = 3600  # pruning never removes an entry used this recently (another run may be using it)

PACKAGE_DIR = Path(onecopy.__file__).resolve().parent
_EXPORT = onecopy.export  # the real exporter, whatever a test patches `onecopy.export` with later
_SIGNATURE = inspect.signature(onecopy.export)
_used: dict[Path, dict] = {}  # entries handed out in this process -> their fingerprint
_exports: list[tuple[str, float]] = []  # (entry name, seconds) of the exports this process ran
# Wraps each export this process runs (a cache miss); conftest sets it to give the export a timeout of its own.
export_guard: Callable[[], ContextManager[None]] = contextlib.nullcontext
# The compile workers the exports run in (conftest's session pool: kept between exports); None: each its own.
export_workers: CompileWorkers | None = None


def cache_root() -> Path | None:
    """The cache directory, or None when the cache is off (ONECOPY_TEST_CACHE=off)."""
    where = os.environ.get(ENV_DIR)
    if where and where.lower() in ("off", "0", "none", "false"):
        return None
    if where:
        return Path(where).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "onecopy-tests"


@functools.cache
def _session_dir() -> Path:
    """Where bundles go with the cache off: this process's own temporary directory."""
    return Path(tempfile.mkdtemp(prefix="onecopy-test-bundles-"))


# ------------------------------------------------------------------------------------------------------ the key

def _module_file(module: str) -> Path | None:
    p = PACKAGE_DIR.parent.joinpath(*module.split("."))
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return p.with_suffix(".py") if p.with_suffix(".py").is_file() else None


def _imported_modules(path: Path, module: str) -> set[str]:
    """The onecopy modules (and names that may be modules) a file imports, anywhere in it (lazy imports too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "onecopy")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] == "onecopy":
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
    return found


def exporter_modules() -> dict[str, Path]:
    """Every onecopy module the exporter imports, directly or through others, with its file.

    Subpackages' __init__ files count (they run on import), the top-level ``onecopy/__init__.py`` does not
    (it re-exports the public API, the runtime among it, which reads bundles but shapes none)."""
    seen: dict[str, Path] = {}
    todo = ["onecopy.export.exporter"]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for i in range(2, len(parts) + 1):  # the module and its parent packages, but not `onecopy` itself
            name = ".".join(parts[:i])
            f = _module_file(name)
            if f is not None and name not in seen:
                seen[name] = f
                todo.extend(m for m in _imported_modules(f, name) if m not in seen)
    return seen


@functools.cache
def code_hash() -> str:
    """sha256 over the files that shape a bundle (paths relative to the package, and contents)."""
    files = set(exporter_modules().values())
    for name in SHAPING:
        p = PACKAGE_DIR / name
        files.update(f for f in (p.rglob("*") if p.is_dir() else [p]) if f.is_file() and "__pycache__" not in f.parts)
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(str(f.relative_to(PACKAGE_DIR)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _compiler() -> dict[str, str]:
    try:
        from onecopy.toolchain import pick_cxx  # where it is moving to
    except ImportError:
        from onecopy.export.toolchain import pick_cxx
    cxx = pick_cxx()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    return {"cxx": cxx, "version": version[0] if version else "?"}


def environment() -> dict[str, Any]:
    """What besides the code and the source shapes an export here: libraries, compiler, ISA."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    env = {k: os.environ.get(k) for k in CODE_ENV}
    env.update({k: v for k, v in os.environ.items() if k.startswith("TORCHINDUCTOR_") and k not in INDUCTOR_ENV_IGNORED})
    versions = {}
    for lib in LIBRARIES:
        try:
            versions[lib] = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            versions[lib] = None
    return {"env": env, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "vec_isa": str(pick_vec_isa()),
            "machine": platform.machine(), "torch": torch.__version__,
            "torch_git": torch.version.git_version, "cuda": torch.version.cuda, "libraries": versions,
            "compiler": _compiler(), "python": sys.version.split()[0]}


def _hash_value(h: "hashlib._Hash", v: Any) -> None:
    """Feed ``v`` to ``h`` by content (tensors and arrays by their bytes; dataclasses field by field)."""
    import numpy as np

    if isinstance(v, torch.Tensor):
        t = v.detach().cpu().contiguous()
        h.update(f"tensor {t.dtype} {list(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(v, np.ndarray):
        h.update(f"array {v.dtype} {v.shape}".encode() + np.ascontiguousarray(v).tobytes())
    elif dataclasses.is_dataclass(v) and not isinstance(v, type):
        h.update(type(v).__qualname__.encode())
        for f in dataclasses.fields(v):
            h.update(f.name.encode())
            _hash_value(h, getattr(v, f.name))
    elif isinstance(v, dict):
        h.update(b"{")
        for k in sorted(v, key=repr):
            _hash_value(h, k)
            _hash_value(h, v[k])
        h.update(b"}")
    elif isinstance(v, (list, tuple)):
        h.update(b"[")
        for x in v:
            _hash_value(h, x)
        h.update(b"]")
    elif isinstance(v, (str, bytes, int, float, bool, type(None))) or hasattr(v, "value"):  # enums too
        h.update(repr(v).encode())
    else:
        text = repr(v)
        if " at 0x" in text:
            raise TypeError(f"cannot key a bundle by {type(v).__name__} (its repr names an address): {text[:80]}")
        h.update(text.encode())


@functools.cache
def _file_hash(path: Path, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _path_hash(path: Path) -> str:
    """A file's or a directory's contents (relative paths and bytes of every file in it)."""
    path = path.resolve()
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(str(f.relative_to(path) if f != path else f.name).encode() + b"\0")
        h.update(_file_hash(f, st.st_size, st.st_mtime_ns).encode())
    return h.hexdigest()


def source_identity(source: "str | Path | ModelSource") -> dict[str, str]:
    """What names the source's content: a preset's name (its weights are drawn by the hashed code), an
    embedded model's name and files, a path's name and contents, or a ModelSource's fields and tensors."""
    if isinstance(source, ModelSource):
        h = hashlib.sha256()
        _hash_value(h, source)
        return {"kind": "ModelSource", "name": source.name, "content": h.hexdigest()}
    s = str(source)
    if s in PRESETS:
        return {"kind": "preset", "name": s}
    if s == EMBEDDED_DEFAULT:
        return {"kind": "embedded", "name": s, "content": _path_hash(embedded_default_gguf())}
    if s == EMBEDDED_WHISPER:
        return {"kind": "embedded", "name": s, "content": _path_hash(embedded_whisper_dir())}
    path = Path(s).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"bundle source {s!r} is neither a preset, an embedded model nor a path")
    return {"kind": "path", "name": path.name, "content": _path_hash(path)}


def export_options(**options: Any) -> dict[str, Any]:
    """``options`` bound to `onecopy.export`'s signature with its defaults, as JSON-able values (output
    location, overwrite and progress left out: they do not change the bundle)."""
    bound = _SIGNATURE.bind("<source>", "<out>", **options)
    bound.apply_defaults()
    out = {}
    for k, v in bound.arguments.items():
        if k in ("source", "out_dir", "overwrite", "progress", "workers"):  # (where, not what)
            continue
        if isinstance(v, torch.dtype):
            v = str(v)
        elif isinstance(v, (list, tuple)):
            v = list(v)
        out[k] = v
    json.dumps(out)  # options must be plain values
    return out


def bundle_key(source: "str | Path | ModelSource", **options: Any) -> tuple[str, dict[str, Any]]:
    """(sha256 hex, the material it hashes) for the bundle ``onecopy.export(source, **options)`` writes."""
    material = {"source": source_identity(source), "options": export_options(**options), "code": code_hash(),
                "environment": environment()}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest(), material


# ---------------------------------------------------------------------------------------------------- entries

def _fingerprint(bundle: Path) -> dict[str, list[int]]:
    out = {}
    for f in sorted(bundle.rglob("*")):
        if f.is_file() or f.is_symlink():
            st = f.lstat()
            out[str(f.relative_to(bundle))] = [st.st_size, st.st_mtime_ns]
    return out


def _valid(entry: Path) -> dict | None:
    """The entry's record if it is complete and nothing in it changed since it was written."""
    try:
        record = json.loads((entry / ENTRY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("fingerprint") == _fingerprint(entry / BUNDLE_DIR) else None


def _read_only(tree: Path) -> None:
    for f in tree.rglob("*"):
        if f.is_file() and not f.is_symlink():
            f.chmod(f.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def _remove(path: Path) -> None:
    def writable(func, p, _exc):  # read-only files in a directory we may write: make them go anyway
        os.chmod(p, stat.S_IRWXU)
        func(p)

    shutil.rmtree(path, onexc=writable) if sys.version_info >= (3, 12) else shutil.rmtree(path, onerror=writable)


def _slug(source: "str | Path | ModelSource") -> str:
    name = source.name if isinstance(source, ModelSource) else Path(str(source)).name
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:40] or "bundle"


def cached_bundle(source: "str | Path | ModelSource", **options: Any) -> Path:
    """The bundle `onecopy.export(source, **options)` writes, exported once into the cache (see the module
    doc). Read it, load it, never write into it: damage a `conftest.copy_bundle` copy instead."""
    key, material = bundle_key(source, **options)
    root = cache_root() or _session_dir()
    name = f"{_slug(source)}-{key[:20]}"
    entry = root / name
    record = _valid(entry)
    if record is None:
        root.mkdir(parents=True, exist_ok=True)
        (root / ".locks").mkdir(exist_ok=True)
        with open(root / ".locks" / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when this process dies
            record = _valid(entry)  # another process may have exported it meanwhile
            if record is None:
                record = _export(source, options, material, root, entry)
    _touch(entry)
    _used[entry] = record["fingerprint"]
    return entry / BUNDLE_DIR


def _export(source, options: dict, material: dict, root: Path, entry: Path) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=root))
    try:
        t0 = time.monotonic()
        pool = export_workers if "jobs" not in options else None
        with export_guard():
            _EXPORT(source, tmp / BUNDLE_DIR, progress=False, workers=pool, **options)
        seconds = time.monotonic() - t0
        _read_only(tmp / BUNDLE_DIR)
        record = {"key": material, "fingerprint": _fingerprint(tmp / BUNDLE_DIR), "export_seconds": round(seconds, 1),
                  "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (tmp / ENTRY_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
        if entry.exists():  # damaged or incomplete: nobody can be using it
            _remove(entry)
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users sharing the cache
        os.rename(tmp, entry)  # atomic: other processes see the whole entry or none
        _exports.append((entry.name, seconds))
        return record
    finally:
        if tmp.exists():
            _remove(tmp)


def _touch(entry: Path) -> None:
    """The entry directory's mtime says when it was last used (what pruning goes by)."""
    try:
        os.utime(entry, None)
    except OSError:
        pass


def exports_run() -> list[tuple[str, float]]:
    """(entry, seconds) of each export this process ran (the cache's misses)."""
    return list(_exports)


def entries_used() -> list[str]:
    """The entries this process took from the cache (exported here or reused), each once."""
    return sorted({e.name for e in _used})


def check_entries_used() -> list[str]:
    """Entries handed out in this process whose files changed since (a test wrote into the cache): each is
    removed, so that the next run exports it again, and named in the returned list."""
    damaged = []
    for entry, fingerprint in _used.items():
        if entry.exists() and _fingerprint(entry / BUNDLE_DIR) != fingerprint:
            damaged.append(entry.name)
            _remove(entry)
    return damaged


def prune(max_bytes: int | None = None) -> list[str]:
    """Remove least-recently-used entries (never one used in the last hour, nor by this process) until the
    cache holds at most ``max_bytes`` ($ONECOPY_TEST_CACHE_MAX_GB GiB, default 20), and temporary
    directories of exports that died over a day ago. Returns the names removed."""
    root = cache_root()
    if root is None or not root.is_dir():
        return []
    if max_bytes is None:
        max_bytes = int(float(os.environ.get(ENV_MAX_GB, "20")) * 2**30)
    now, removed = time.time(), []
    for tmp in root.glob(".tmp-*"):
        if now - tmp.stat().st_mtime > 86400:
            _remove(tmp)
    entries = []
    for e in root.iterdir():
        if e.is_dir() and not e.name.startswith("."):
            size = sum(f.lstat().st_size for f in e.rglob("*"))
            entries.append((e.stat().st_mtime, size, e))
    total = sum(size for _, size, _ in entries)
    for used, size, e in sorted(entries):
        if total <= max_bytes:
            break
        if now - used < KEEP_UNUSED_S or e in _used:
            continue
        (root / ".locks").mkdir(exist_ok=True)
        with open(root / ".locks" / f"{e.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being exported right now
            _remove(e)
        removed.append(e.name)
        total -= size
    return removed
