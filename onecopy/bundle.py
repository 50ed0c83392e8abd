"""The bundle on disk: manifest.json + weights.safetensors + methods/<name>.pt2 + tokenizer.json.

Reading is split from loading: `read_bundle` checks everything that can be checked without a
device (format version, files, shapes, dtypes, content hashes, coverage, device kind) and
returns a `Bundle` whose weights are still views of the mapped file. Nothing is bound to a
device until every check has passed.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import (BundleNotFoundError, CoverageError, DeviceMismatchError, ManifestError, TorchVersionMismatchError,
                     UnknownWeightLayoutError, UnsupportedFormatVersionError, WeightsCorruptError, WeightSpecError)
from .layouts import LAYOUTS, PACKED_PARTS, check_packed

FORMAT = "onecopy-bundle"
FORMAT_VERSION = 3  # 3: KV state may be paged (blocks + a block table); 2: state is a pool with a row per session
READABLE_VERSIONS = (2, 3)  # a version-2 bundle is a version 3 one without paged state
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
TOKENIZER = "tokenizer.json"

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


def table_width(max_seq_len: int, kv_block_size: int) -> int:
    """Blocks in one session's block table: enough for max_seq_len + 1 positions (one spare, as a row has)."""
    return -(-(max_seq_len + 1) // kv_block_size)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"unknown dtype {name!r} in manifest; the bundle is damaged, export it again")
    return dtype


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying them."""
    return memoryview(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy())


def sha256_many(buffers: list[bytes | memoryview]) -> list[str]:
    """Content hashes of many buffers, in threads (hashlib releases the GIL: gigabytes take seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        return list(pool.map(sha256, buffers))


@dataclass
class TensorSpec:
    shape: list[int]  # state: the shape of one session's row (the pool adds a leading row dim)
    dtype: str
    sha256: str | None = None  # weights only
    init: str | None = None  # state only: "zeros"
    recurrent: bool | None = None  # state only: not addressed by position, so a step cannot be undone
    paged: bool | None = None  # state only: laid out in blocks of kv_block_size positions (shape: one block)

    @property
    def nbytes(self) -> int:
        n = parse_dtype(self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class InputSpec:
    """One method input. A dim is an int (static) or {"min": a, "max": b} (dynamic).

    ``range`` ([lo, hi)) bounds the values of an integer input (token ids: the vocabulary;
    positions: max_seq_len); the runtime checks it on the host before any kernel runs.
    """

    name: str
    dtype: str
    shape: list[Any]
    range: list[int] | None = None


# What a method does for a session, so the runtime knows how to drive it:
#   decode:  (tokens[B, 1], input_pos[B], rows[B]) one token for each of B sessions (batched, graph-captured)
#   prefill: (tokens[1, T], input_pos[T], rows[1]) a chunk of one session's prompt, or
#            (tokens[N, T], input_pos[N, T], ..., rows[N]) equal-length chunks of N sessions' prompts
#   encode:  (inputs..., rows[1]) fills one session's state from an input (e.g. audio features)
ROLES = ("decode", "prefill", "encode")


@dataclass
class MethodSpec:
    """One compiled method. Its package takes ``inputs``, then ``rows`` (int64, the state-pool rows
    it works on) and then one pool tensor per FQN in ``state`` (leading dim: pool rows)."""

    name: str
    package: str
    package_sha256: str
    weights: str  # "external": weightless, bound to the store; "embedded": carries its own (fallback)
    inputs: list[InputSpec]
    constants: list[str]
    state: list[str]  # state FQNs the method takes (in this order, after rows)
    writes: list[str] = field(default_factory=list)  # the subset of `state` it writes in place
    role: str = ""
    mutated_constants: list[str] = field(default_factory=list)  # constants written in place: sessions would share them
    batch_invariant: bool = False  # decode: each row's results independent of the batch it runs in
    paged: bool = False  # takes the KV block table [P, NBMAX] (int64) right after rows
    native_ops: list[str] = field(default_factory=list)  # op libraries the package calls by name (`kernels.native`)


@dataclass
class Manifest:
    family: str
    config: dict[str, Any]
    max_seq_len: int
    dtype: str
    device_kind: str
    methods: dict[str, MethodSpec]
    weights: dict[str, TensorSpec]
    state: dict[str, TensorSpec]
    tokenizer: dict[str, Any]
    generation: dict[str, Any]
    build: dict[str, Any] = field(default_factory=dict)
    weights_file: str = WEIGHTS
    format_version: int = FORMAT_VERSION
    kv_block_size: int | None = None  # positions per KV block when state is paged
    # layers whose weight is packed (quantized): name -> {layout, group, shape [N, K], source}; their
    # tensors are the weights <name>.qweight, .scales and (affine layouts) .mins (`layouts`)
    packed: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def paged_state(self) -> list[str]:
        """State FQNs laid out in blocks (paged KV); the rest has a row per session."""
        return [k for k, v in self.state.items() if v.paged]

    @property
    def kv_8bit(self) -> bool:
        """Whether the KV cache is stored in 8 bits with a float32 scale per position and head (`models.kv_quant`)."""
        return any(k.endswith(("k_scale", "v_scale")) for k in self.state)

    def kv_dtype_description(self) -> str:
        """The KV cache's storage: the values' dtype and, for an 8-bit cache (`models.kv_quant`), its scales."""
        values = sorted({v.dtype for k, v in self.state.items() if k.endswith(("k_cache", "v_cache"))})
        return "/".join(values) + (" values, a float32 scale per position and head" if self.kv_8bit else "")

    def packed_fqns(self, layer: str) -> list[str]:
        """The weight FQNs holding packed ``layer`` (values, scales and, affine layouts, mins)."""
        return [f for f in (f"{layer}.{part}" for part in PACKED_PARTS) if f in self.weights]

    @property
    def table_width(self) -> int:
        """Blocks in one session's block table (0 without paged state): max_seq_len + 1 positions."""
        return table_width(self.max_seq_len, self.kv_block_size) if self.kv_block_size else 0

    def fingerprint(self) -> str:
        """Identity of the model a session state belongs to (config, weight hashes, state layout)."""
        payload = {"config": self.config, "max_seq_len": self.max_seq_len,
                   "weights": {k: v.sha256 for k, v in self.weights.items()},
                   "state": {k: [v.shape, v.dtype] for k, v in self.state.items()}}
        return sha256(json.dumps(payload, sort_keys=True).encode())

    def to_json(self) -> str:
        d = {"format": FORMAT, "format_version": self.format_version, "family": self.family, "config": self.config,
             "max_seq_len": self.max_seq_len, "dtype": self.dtype, "device_kind": self.device_kind,
             "build": self.build, "weights_file": self.weights_file,
             "weights": {k: vars(v) for k, v in self.weights.items()},
             "state": {k: vars(v) for k, v in self.state.items()},
             "methods": {k: {**vars(m), "inputs": [vars(i) for i in m.inputs]} for k, m in self.methods.items()},
             "tokenizer": self.tokenizer, "generation": self.generation, "kv_block_size": self.kv_block_size,
             "packed": self.packed}
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str, where: Path) -> "Manifest":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{where} is not valid JSON ({e}); the bundle is truncated or damaged: export it again") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ManifestError(f"{where} is not an onecopy bundle manifest; export the model with `onecopy export`")
        version = d.get("format_version")
        if version not in READABLE_VERSIONS:
            raise UnsupportedFormatVersionError(
                f"bundle format version {version!r} is not supported (this onecopy reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}); "
                "export the model again with this onecopy, or use the onecopy release that wrote it")
        try:
            methods = {k: MethodSpec(**{**m, "inputs": [InputSpec(**i) for i in m["inputs"]]})
                       for k, m in d["methods"].items()}
            bad_roles = {k: m.role for k, m in methods.items() if m.role not in ROLES}
            if bad_roles:
                raise ValueError(f"unknown method roles {bad_roles}; this onecopy knows {', '.join(ROLES)}")
            block = d.get("kv_block_size")
            state = {k: TensorSpec(**v) for k, v in d["state"].items()}
            paged = [k for k, v in state.items() if v.paged]
            if paged and not (isinstance(block, int) and block >= 1):
                raise ValueError(f"state {paged[:2]} is paged but kv_block_size is {block!r}")
            if block is not None and not paged:
                raise ValueError(f"kv_block_size={block!r} but no state is paged")
            if any(m.paged != bool(paged) for m in methods.values()):
                raise ValueError("methods disagree with the state on whether the KV cache is paged")
            weights = {k: TensorSpec(**v) for k, v in d["weights"].items()}
            packed = d.get("packed") or {}
            _check_packed(packed, weights, where)
            return cls(family=d["family"], config=d["config"], max_seq_len=int(d["max_seq_len"]), dtype=d["dtype"],
                       device_kind=d["device_kind"], methods=methods, weights=weights, packed=packed,
                       state=state, tokenizer=d["tokenizer"], generation=d["generation"], build=d.get("build", {}),
                       weights_file=d.get("weights_file", WEIGHTS), format_version=version, kv_block_size=block)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"{where} lacks or mangles a required field ({e!r}); export the bundle again") from e


def _check_packed(packed: dict[str, dict[str, Any]], weights: dict[str, TensorSpec], where: Path) -> None:
    """Every packed layer's layout is one this onecopy reads and its tensors are in the weights, shaped
    as the layout says; else UnknownWeightLayoutError (a newer layout) or ManifestError."""
    for name, p in packed.items():
        layout = p.get("layout")
        if layout not in LAYOUTS:
            raise UnknownWeightLayoutError(
                f"{where}: layer {name!r} has weight layout {layout!r}, which this onecopy cannot read (it reads "
                f"{', '.join(LAYOUTS)}); run it with the onecopy release that exported it, or export the model again")
        parts = {part: weights.get(f"{name}.{part}") for part in PACKED_PARTS}
        if parts["mins"] is None:
            parts.pop("mins")
        try:
            if parts["qweight"] is None or parts["scales"] is None:
                raise ValueError(f"its tensors {name}.qweight / {name}.scales are not among the weights")
            meta = {k: torch.empty(v.shape, dtype=parse_dtype(v.dtype), device="meta") for k, v in parts.items()}
            check_packed(layout, int(p["group"]), tuple(p["shape"]), meta["qweight"], meta["scales"], meta.get("mins"))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where}: packed layer {name!r} does not match its weights ({e}); export again") from e


@dataclass
class Bundle:
    """A validated bundle: manifest plus zero-copy views of its weights (valid while `close` is not called)."""

    path: Path
    manifest: Manifest
    weights: dict[str, torch.Tensor]  # CPU views into the mapped weight file
    _mmap: mmap.mmap | None = None
    _file: Any = None

    def package_path(self, method: str) -> Path:
        return self.path / self.manifest.methods[method].package

    def close(self) -> None:
        self.weights = {}
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with it
            self._file.close()
            self._mmap = self._file = None


def bundle_file(path: Path, relative: str, what: str) -> Path:
    """``path / relative``, refused unless it stays inside the bundle directory (no absolute paths,
    no ``..``, no symlink leading out): a manifest must never make the runtime read other files."""
    root = Path(path).resolve()
    target = (root / relative).resolve()
    if not isinstance(relative, str) or Path(relative).is_absolute() or not target.is_relative_to(root):
        raise ManifestError(f"the manifest's path {relative!r} for {what} points outside the bundle directory {root}; "
                            "a bundle only reads its own files: export it again")
    return Path(path) / relative


def read_manifest(path: Path) -> Manifest:
    """Read and check manifest.json: format, fields, and that every file it names lies inside ``path``."""
    path = Path(path)
    if not path.is_dir():
        raise BundleNotFoundError(f"bundle directory {path} does not exist; create it with `onecopy export SOURCE --out {path}`")
    mf = path / MANIFEST
    if not mf.is_file():
        raise BundleNotFoundError(f"{mf} is missing; this is not a complete bundle: export it again")
    m = Manifest.from_json(mf.read_text(errors="replace"), mf)
    for spec in m.methods.values():
        bundle_file(path, spec.package, f"the package of method {spec.name!r}")
    bundle_file(path, m.weights_file, "the weights")
    if isinstance(m.tokenizer, dict) and "file" in m.tokenizer:
        bundle_file(path, m.tokenizer["file"], "the tokenizer")
    return m


def _read_safetensors(file: Path) -> tuple[dict[str, Any], mmap.mmap, Any, int]:
    f = open(file, "rb")
    try:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError as e:  # empty file
        f.close()
        raise WeightsCorruptError(f"{file} is empty; export the bundle again") from e
    try:
        (n,) = struct.unpack("<Q", mm[:8])
        header = json.loads(mm[8:8 + n])
    except Exception as e:
        mm.close()
        f.close()
        raise WeightsCorruptError(f"{file} has an unreadable safetensors header ({e}); export the bundle again") from e
    header.pop("__metadata__", None)
    return header, mm, f, 8 + n


def _view(buf: memoryview, spec: TensorSpec) -> torch.Tensor:
    dtype = parse_dtype(spec.dtype)
    if not spec.nbytes:
        return torch.empty(spec.shape, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only mapping: we only ever copy out of it
        return torch.frombuffer(buf, dtype=dtype).view(spec.shape)


def read_bundle(path: str | Path, device_kind: str) -> Bundle:
    """Validate a bundle completely (no device work): raises a BundleError subclass on any defect."""
    path = Path(path)
    m = read_manifest(path)
    if m.device_kind != device_kind:
        raise DeviceMismatchError(
            f"bundle {path} was compiled for {m.device_kind!r} but you asked for {device_kind!r}; "
            f"load it with device={m.device_kind!r}, or export again with --device {device_kind}")
    built, running = m.build.get("torch", ""), torch.__version__
    if built and built.split(".")[:2] != running.split(".")[:2]:
        raise TorchVersionMismatchError(
            f"bundle {path} was compiled by torch {built} but this is torch {running}; AOTInductor packages only "
            "load into the release that built them: export the bundle again here")
    for spec in m.methods.values():
        pkg = path / spec.package
        if not pkg.is_file():
            raise BundleNotFoundError(f"method package {pkg} is missing; export the bundle again")
        if sha256(pkg.read_bytes()) != spec.package_sha256:
            raise WeightsCorruptError(f"method package {pkg} does not match its hash in the manifest; export the bundle again")
        missing = sorted(set(spec.constants) - set(m.weights))
        if missing:
            raise CoverageError(f"method {spec.name!r} needs constants the bundle does not provide: {missing[:5]}; "
                                "the manifest and packages come from different exports: export again")
        undeclared = sorted(set(spec.state) - set(m.state))
        if undeclared or not set(spec.writes) <= set(spec.state):
            which = (undeclared or sorted(set(spec.writes) - set(spec.state)))[:5]
            raise CoverageError(f"method {spec.name!r} takes state {which} "
                                "that the manifest does not declare; the manifest is damaged: export again")
    wfile = path / m.weights_file
    if not wfile.is_file():
        raise BundleNotFoundError(f"weight file {wfile} is missing; export the bundle again")
    header, mm, f, base = _read_safetensors(wfile)
    bundle = Bundle(path=path, manifest=m, weights={}, _mmap=mm, _file=f)
    weights = bundle.weights
    try:
        views = {}
        for fqn, spec in m.weights.items():
            entry = header.get(fqn)
            if entry is None:
                raise WeightSpecError(f"weight {fqn!r} is listed in the manifest but missing from {wfile.name}; export again")
            if _ST_DTYPES.get(entry["dtype"]) != parse_dtype(spec.dtype) or list(entry["shape"]) != list(spec.shape):
                raise WeightSpecError(
                    f"weight {fqn!r} is {entry['dtype']}{entry['shape']} in {wfile.name} but the manifest expects "
                    f"{spec.dtype}{spec.shape}; the files come from different exports: export again")
            start, end = (base + o for o in entry["data_offsets"])
            if end > len(mm) or end - start != spec.nbytes:
                raise WeightsCorruptError(f"{wfile.name} is truncated at weight {fqn!r}; export the bundle again")
            views[fqn] = memoryview(mm)[start:end]
        for (fqn, view), digest in zip(views.items(), sha256_many(list(views.values()))):
            if digest != m.weights[fqn].sha256:
                raise WeightsCorruptError(
                    f"weight {fqn!r} in {wfile.name} does not match its content hash (the file is corrupt); export again")
            weights[fqn] = _view(view, m.weights[fqn])
        return bundle
    except BaseException:
        bundle.close()
        raise
