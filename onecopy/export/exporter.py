"""Export a model into a bundle: torch.export each method, AOTInductor-compile it without constants."""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from ..bundle import (FORMAT_VERSION, MANIFEST, TOKENIZER, WEIGHTS, InputSpec, Manifest, MethodSpec, TensorSpec,
                      dtype_name, sha256, tensor_bytes)
from ..errors import ExportError
from ..models.llama import Transformer
from ..models.source import ModelSource, resolve_source
from .toolchain import pick_cxx

METHODS = ("prefill", "decode")


def default_dtype(device: str) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slow there), bf16 on CUDA."""
    return torch.float32 if device == "cpu" else torch.bfloat16


def method_inputs(method: str, max_seq_len: int, device: str) -> tuple[tuple[torch.Tensor, ...], tuple, list[InputSpec]]:
    """Example inputs, dynamic shapes and manifest input specs of a method."""
    if method == "decode":
        args = (torch.zeros(1, 1, dtype=torch.long, device=device), torch.zeros(1, dtype=torch.long, device=device))
        return args, ({}, {}), [InputSpec("tokens", "int64", [1, 1]), InputSpec("input_pos", "int64", [1])]
    if method == "prefill":
        if max_seq_len < 2:
            raise ExportError("prefill needs max_seq_len >= 2")
        n = min(8, max_seq_len)
        seq = torch.export.Dim("seq_len", min=2, max=max_seq_len)
        args = (torch.zeros(1, n, dtype=torch.long, device=device), torch.arange(n, device=device))
        dim = {"min": 2, "max": max_seq_len}
        return args, ({1: seq}, {0: seq}), [InputSpec("tokens", "int64", [1, dim]), InputSpec("input_pos", "int64", [dim])]
    raise ExportError(f"unknown method {method!r}; the Llama family has {', '.join(METHODS)}")


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="step", bar_format="{desc:<28} {bar} {n_fmt}/{total_fmt} [{elapsed}]")


def export(source: "str | Path | ModelSource", out_dir: str | Path, *, max_seq_len: int,
           dtype: torch.dtype | str | None = None, device: str = "cpu", methods: Sequence[str] = METHODS,
           embed_weights: Sequence[str] = (), overwrite: bool = False, progress: bool = True) -> Path:
    """Export ``source`` into a bundle at ``out_dir`` and return its path.

    Each method is exported and compiled without constants (weightless package); methods named in
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
    unknown = set(embed_weights) - set(methods)
    if unknown:
        raise ExportError(f"embed_weights names methods that are not exported: {sorted(unknown)}")
    bar = _progress(2 + 2 * len(methods) + 1, progress)
    step = (lambda d: (bar.set_description_str(d), bar.refresh())) if bar else (lambda d: None)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        step("load source")
        src = resolve_source(source)
        model = src.build(max_seq_len, dtype, device)
        bar and bar.update()
        (tmp / "methods").mkdir(parents=True)
        cxx = pick_cxx()
        specs = {}
        for name in methods:
            step(f"export {name}")
            ep = _export_method(model, name, max_seq_len, device)
            bar and bar.update()
            step(f"compile {name}")
            specs[name] = _compile_method(model, ep, name, max_seq_len, device, tmp, cxx, name in embed_weights)
            bar and bar.update()
        step("write bundle")
        _write_bundle(tmp, src, model, specs, max_seq_len, dtype, device, cxx)
        bar and bar.update()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        step("done")
        bar and bar.update()
        return out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar and bar.close()


def _export_method(model: Transformer, name: str, max_seq_len: int, device: str) -> torch.export.ExportedProgram:
    args, dyn, _ = method_inputs(name, max_seq_len, device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, args, dynamic_shapes=dyn, strict=False)
        # torch keeps in-place buffer writes in the graph; the decomposed signature names them.
        mutated = set(ep.run_decompositions().graph_signature.buffers_to_mutate.values())
    declared = set(model.state_fqns())
    if mutated != declared:
        raise ExportError(
            f"method {name!r} mutates {sorted(mutated - declared)[:4]} beyond the declared state and leaves "
            f"{sorted(declared - mutated)[:4]} untouched; refusing to write a bundle whose sessions would share state")
    return ep


def _compile_method(model: Transformer, ep: torch.export.ExportedProgram, name: str, max_seq_len: int, device: str,
                    tmp: Path, cxx: str, embed: bool) -> MethodSpec:
    pkg = tmp / "methods" / f"{name}.pt2"
    configs: dict = {"cpp.cxx": (cxx,)}
    if not embed:
        configs.update({"always_keep_tensor_constants": True, "aot_inductor.package_constants_in_so": False})
    t0 = time.time()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._inductor.aoti_compile_and_package(ep, package_path=str(pkg), inductor_configs=configs)
    sig = ep.graph_signature
    constants = sorted([*sig.parameters, *sig.buffers, *sig.lifted_tensor_constants])
    _, _, inputs = method_inputs(name, max_seq_len, device)
    return MethodSpec(name=name, package=f"methods/{name}.pt2", package_sha256=sha256(pkg.read_bytes()),
                      weights="embedded" if embed else "external", inputs=inputs, constants=constants,
                      state=sorted(model.state_fqns()))


def _write_bundle(tmp: Path, src: ModelSource, model: Transformer, specs: dict[str, MethodSpec], max_seq_len: int,
                  dtype: torch.dtype, device: str, cxx: str) -> None:
    from safetensors.torch import save_file

    state_fqns = set(model.state_fqns())
    # state_dict() already lists a tied tensor once per owner; we tie by reusing the embedding.
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in state_fqns}
    save_file(weights, str(tmp / WEIGHTS))
    state = {k: TensorSpec(shape=list(v.shape), dtype=dtype_name(v.dtype), init="zeros")
             for k, v in model.state_dict().items() if k in state_fqns}
    (tmp / TOKENIZER).write_text(src.tokenizer_json)
    manifest = Manifest(
        family=src.family, config=src.config.to_dict(), max_seq_len=max_seq_len, dtype=dtype_name(dtype),
        device_kind=device, methods=specs,
        weights={k: TensorSpec(shape=list(v.shape), dtype=dtype_name(v.dtype), sha256=sha256(tensor_bytes(v)))
                 for k, v in weights.items()},
        state=state,
        tokenizer={"file": TOKENIZER, "bos_token_id": src.bos_token_id},
        generation={"eos_token_ids": src.eos_token_ids, "chat_template": src.chat_template},
        build={"source": src.name, "torch": torch.__version__, "cxx": cxx,
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        format_version=FORMAT_VERSION)
    (tmp / MANIFEST).write_text(manifest.to_json())
