"""Export a model into a bundle: torch.export each method, AOTInductor-compile it without constants."""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from ..bundle import (FORMAT_VERSION, MANIFEST, TOKENIZER, WEIGHTS, Manifest, MethodSpec, TensorSpec, dtype_name,
                      sha256, tensor_bytes)
from ..errors import ExportError
from ..models.base import MethodDef
from ..models.source import ModelSource, resolve_source
from .toolchain import pick_cxx



def default_dtype(device: str) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slow there), bf16 on CUDA."""
    return torch.float32 if device == "cpu" else torch.bfloat16


class _Progress:
    """A bar of named export steps on stderr, or nothing when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="step", bar_format="{desc:<28} {bar} {n_fmt}/{total_fmt} [{elapsed}]")

    def step(self, description: str) -> None:
        if self.bar:
            self.bar.set_description_str(description)
            self.bar.refresh()

    def done(self) -> None:
        if self.bar:
            self.bar.update()

    def close(self) -> None:
        if self.bar:
            self.bar.close()


def export(source: "str | Path | ModelSource", out_dir: str | Path, *, max_seq_len: int | None = None,
           dtype: torch.dtype | str | None = None, device: str = "cpu", methods: Sequence[str] | None = None,
           embed_weights: Sequence[str] = (), overwrite: bool = False, progress: bool = True) -> Path:
    """Export ``source`` into a bundle at ``out_dir`` and return its path.

    ``max_seq_len`` defaults to the family's natural bound (Llama: min(2048, the model's context);
    Whisper: its 448 decoder positions). ``methods`` defaults to every method of the model's family (Llama: prefill, decode; Whisper:
    encoder, decoder). Each is exported and compiled without constants (weightless package); methods named in
    ``embed_weights`` are compiled the default way, carrying their own weights (the fallback path,
    kept for compatibility tests). The bundle is written to a temporary directory and renamed into
    place only when complete, so a failed export leaves nothing behind.
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ExportError(f"{out} already exists; pass overwrite=True (--overwrite) or choose another --out")
    if device not in ("cpu", "cuda"):
        raise ExportError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ExportError("device='cuda' asked for but no CUDA GPU is visible; export with --device cpu")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or default_dtype(device)
    bar = _Progress(0, False)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if progress:
            print(f"reading {source if not isinstance(source, ModelSource) else source.name} ...", file=sys.stderr)
        src = resolve_source(source)
        bound = src.config.max_target_positions if src.family == "whisper" else src.config.max_position_embeddings
        if max_seq_len is None:
            max_seq_len = bound if src.family == "whisper" else min(2048, bound)
        if not 1 <= max_seq_len <= (bound if src.family == "whisper" else 1 << 20):
            raise ExportError(f"max_seq_len={max_seq_len} is out of range for {src.name}; "
                              f"use 1..{bound} (--max-seq-len)")
        model = src.build(max_seq_len, dtype, device)
        available = model.export_methods(max_seq_len, device)
        methods = list(available) if methods is None else list(methods)
        unknown = sorted(set(methods) - set(available)) + sorted(set(embed_weights) - set(methods))
        if unknown or not methods:
            raise ExportError(f"cannot export methods {unknown or methods}: {src.family} models have "
                              f"{', '.join(available)} (embed_weights must name exported methods)")
        bar = _Progress(2 * len(methods) + 3, progress)
        bar.done()  # the source is read
        (tmp / "methods").mkdir(parents=True)
        cxx = pick_cxx()
        specs, mutated = {}, set()
        declared = set(model.state_fqns())
        for name in methods:
            bar.step(f"export {name}")
            ep, method_mutates = _export_method(available[name], name, declared)
            mutated |= method_mutates
            bar.done()
            bar.step(f"compile {name}")
            specs[name] = _compile_method(ep, available[name], name, tmp, cxx, name in embed_weights, method_mutates)
            bar.done()
        if mutated != declared and set(methods) == set(available):
            raise ExportError(f"the methods never write the declared state {sorted(declared - mutated)[:4]}; "
                              "refusing to write a bundle whose state declaration is wrong")
        bar.step("write bundle")
        _write_bundle(tmp, src, model, specs, max_seq_len, dtype, device, cxx)
        bar.done()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        bar.step("done")
        bar.done()
        return out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()


def _export_method(method: MethodDef, name: str, declared: set[str]) -> tuple[torch.export.ExportedProgram, set[str]]:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(method.module, method.args, dynamic_shapes=method.dynamic_shapes, strict=False)
        # torch keeps in-place buffer writes in the graph; the decomposed signature names them.
        mutated = set(ep.run_decompositions().graph_signature.buffers_to_mutate.values())
    if not mutated <= declared:
        raise ExportError(
            f"method {name!r} mutates {sorted(mutated - declared)[:4]} beyond the declared state; "
            "refusing to write a bundle whose sessions would share state")
    return ep, mutated


def _compile_method(ep: torch.export.ExportedProgram, method: MethodDef, name: str, tmp: Path, cxx: str, embed: bool,
                    mutated: set[str]) -> MethodSpec:
    pkg = tmp / "methods" / f"{name}.pt2"
    configs: dict = {"cpp.cxx": (cxx,)}
    if not embed:
        configs.update({"always_keep_tensor_constants": True, "aot_inductor.package_constants_in_so": False})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._inductor.aoti_compile_and_package(ep, package_path=str(pkg), inductor_configs=configs)
    # What the compiled package really reads (unused parameters are dropped), not the signature.
    constants = sorted(torch._inductor.aoti_load_package(str(pkg)).get_constant_fqns())
    return MethodSpec(name=name, package=f"methods/{name}.pt2", package_sha256=sha256(pkg.read_bytes()),
                      weights="embedded" if embed else "external", inputs=method.inputs, constants=constants,
                      state=sorted(mutated))


def _write_bundle(tmp: Path, src: ModelSource, model: torch.nn.Module, specs: dict[str, MethodSpec], max_seq_len: int,
                  dtype: torch.dtype, device: str, cxx: str) -> None:
    from safetensors.torch import save_file

    state_fqns = set(model.state_fqns())
    tensors = model.state_dict()  # tied weights appear once: the models reuse the embedding, no alias FQN
    weights = {k: v.detach().contiguous().cpu() for k, v in tensors.items() if k not in state_fqns}
    save_file(weights, str(tmp / WEIGHTS))
    state = {k: TensorSpec(shape=list(v.shape), dtype=dtype_name(v.dtype), init="zeros")
             for k, v in tensors.items() if k in state_fqns}
    (tmp / TOKENIZER).write_text(src.tokenizer_json)
    manifest = Manifest(
        family=src.family, config=src.config.to_dict(), max_seq_len=max_seq_len, dtype=dtype_name(dtype),
        device_kind=device, methods=specs,
        weights={k: TensorSpec(shape=list(v.shape), dtype=dtype_name(v.dtype), sha256=sha256(tensor_bytes(v)))
                 for k, v in weights.items()},
        state=state,
        tokenizer={"file": TOKENIZER, "bos_token_id": src.bos_token_id},
        generation={"eos_token_ids": src.eos_token_ids, "chat_template": src.chat_template, **src.generation},
        build={"source": src.name, "torch": torch.__version__, "cxx": cxx,
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        format_version=FORMAT_VERSION)
    (tmp / MANIFEST).write_text(manifest.to_json())
