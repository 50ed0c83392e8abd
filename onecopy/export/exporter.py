"""Export a model into a bundle: torch.export each method, AOTInductor-compile it without constants."""

from __future__ import annotations

import logging
import operator
import os
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..bundle import (FORMAT_VERSION, MANIFEST, TOKENIZER, WEIGHTS, Manifest, MethodSpec, TensorSpec, dtype_name,
                      sha256, sha256_many, tensor_view)
from ..errors import ExportError, OnecopyError
from ..kernels.cpu import LIBRARY as CPU_LIBRARY
from ..kernels import native
from ..kernels.native import LIBRARY as NATIVE_LIBRARY
from ..layouts import GROUPS
from ..models import kv_quant
from ..models.base import MethodDef
from ..models.quantize import DEFAULT_GROUP, QUANTIZE_MODES, order_tiles, pack_gguf, packed_layers, quantize_model
from ..models.source import ModelSource, resolve_source
from ..toolchain import pick_cxx
from .compile_worker import CompileWorkers, Compiled, compile_jobs, compile_package, make_task

log = logging.getLogger(__name__)

DEFAULT_KV_BLOCK = 16  # positions per KV block: vLLM's default; the prefix cache shares whole blocks


def default_dtype(device: str) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are slow there), bf16 on CUDA."""
    return torch.float32 if device == "cpu" else torch.bfloat16


def progress_note(message: str, progress: bool) -> None:
    """One line of an export's progress: on stderr with ``progress`` (`tqdm.write`, so that it never
    lands inside a bar), else logged at INFO (`logging.getLogger(__name__)`)."""
    if progress:
        from tqdm import tqdm
        tqdm.write(message, file=sys.stderr)
    else:
        log.info(message)


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


class _Clock:
    """Seconds per export phase into ``timings`` (when given): ``phases`` in order, and what each adds."""

    def __init__(self, timings: dict[str, Any] | None) -> None:
        self.timings = timings
        self.start = self.last = time.perf_counter()
        if timings is not None:
            timings.setdefault("phases", {})

    def lap(self, phase: str, detail: dict[str, Any] | None = None) -> None:
        now = time.perf_counter()
        log.info("export: %s took %.1f s (%.1f s in all)", phase, now - self.last, now - self.start)  # as it happens
        if self.timings is not None:
            self.timings["phases"][phase] = round(now - self.last, 3)
            if detail:
                self.timings.setdefault("detail", {})[phase] = detail
        self.last = now

    def done(self) -> None:
        if self.timings is not None:
            self.timings["total"] = round(time.perf_counter() - self.start, 3)


def export(source: "str | Path | ModelSource", out_dir: str | Path, *, max_seq_len: int | None = None,
           dtype: torch.dtype | str | None = None, device: str = "cpu", methods: Sequence[str] | None = None,
           embed_weights: Sequence[str] = (), overwrite: bool = False, progress: bool = True,
           kv_block: int | None = DEFAULT_KV_BLOCK, dequantize: bool | None = None, quantize: str | None = None,
           group_size: int = DEFAULT_GROUP, kv_dtype: str | None = None, native_kernels: bool = True,
           jobs: int | None = None, timings: dict[str, Any] | None = None,
           workers: CompileWorkers | None = None) -> Path:
    """Export ``source`` into a bundle at ``out_dir`` and return its path.

    ``max_seq_len`` defaults to the family's natural bound (Llama: min(2048, the model's context);
    Whisper: its 448 decoder positions). ``methods`` defaults to every method of the model's family (Llama:
    prefill, decode; Whisper: encoder, decoder). Each is exported and compiled without constants
    (weightless package); methods named in
    ``embed_weights`` are compiled the default way, carrying their own weights (the fallback path,
    kept for compatibility tests). The bundle is written to a temporary directory and renamed into
    place only when complete, so a failed export leaves nothing behind.
    ``kv_block``: positions per KV block (paged KV, what the prefix cache shares; Llama family); None
    keeps one row of max_seq_len positions per session. Families without paged KV ignore it.
    A GGUF source's quantized tensors, and a GPTQ / AWQ checkpoint's (`models.prequantized`), stay packed
    (`models.quantize.pack_gguf`) unless ``dequantize``
    (None, the default, is False): the CUDA decode kernels and the CPU's C++ kernel (`kernels.cpu`) read
    them packed (SmolLM2 Q4_1 on 2 cores: 0.24x the float bundle's time per token with a fifth of its weight
    bytes, benchmarks/results/packed_cpu_smollm2.json). True stores them as floats.
    ``quantize`` ("int8" or "int4", with ``group_size`` values per scale) packs a float model's
    projections (`models.quantize.quantize_model`). The manifest records each packed layer's layout.
    ``kv_dtype`` ("int8" or "fp8"; None or "bf16": the model's dtype) stores the KV cache in 8 bits with a
    float32 scale per position and head (`models.kv_quant`; Llama family, paged KV): about half the bytes
    per session and per decode step's read. The state's dtypes in the manifest say which.
    ``native_kernels``: a CUDA export decodes an 8-bit cache with the CUDA C++ kernel where it serves the
    shapes (`kernels.native`, built here with nvcc), writes packed int4 / int8 projections in the tile
    order of its packed-projection kernel (the ``_mma`` layouts, `models.mma_order`) and multiplies FP8
    weights by its FP8 kernel for up to 8 rows; the manifest lists the library under each method's
    ``native_ops`` and the runtime loads it first. False keeps the Triton kernels and cuBLAS (the comparison).
    ``progress``: a bar of the export's steps on stderr, with its notes (the source being read, GGUF layers
    kept float) above it; without it the notes are logged at INFO (`progress_note`).
    ``jobs``: how many methods compile at once, each in a worker process (`export.compile_worker`); None: one
    per CPU (at most one per method), or $ONECOPY_EXPORT_JOBS; 1 compiles them one after another in this
    process. The bundle is the same either way.
    ``workers``: a pool of compile workers the caller owns (`export.compile_worker.CompileWorkers`), used instead
    of starting ``jobs`` new ones and left running for the caller's next export (unless this export fails: then
    they are stopped, and the next export starts them again); a pool started under another environment than the
    process's now is passed over. The bundle is the same either way.
    ``timings``: a dict to fill with seconds per export phase (and Inductor's own timers per method), for
    benchmarks/export_time.py.
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
    if kv_block is not None and not (isinstance(kv_block, int) and 1 <= kv_block <= 4096 and kv_block & (kv_block - 1) == 0):
        raise ExportError(f"kv_block={kv_block!r} must be a power of two in 1..4096 (--kv-block), or None for rows")
    try:
        kv_storage = kv_quant.kv_dtype(kv_dtype)
    except ValueError as e:
        raise ExportError(f"{e} (--kv-dtype)") from None
    if kv_storage == torch.float8_e4m3fn:
        _check_fp8_device(device, "kv_dtype")
    if kv_storage is not None and kv_block is None:
        raise ExportError(f"kv_dtype={kv_dtype!r} needs paged KV: an 8-bit cache is read through blocks; drop "
                          "kv_block=None (--kv-block none)")
    if quantize is not None and quantize not in QUANTIZE_MODES:
        raise ExportError(f"quantize={quantize!r} is not supported; use {' or '.join(QUANTIZE_MODES)} (--quantize)")
    if quantize == "fp8":
        _check_fp8_device(device, "quantize")
    if quantize is not None and group_size not in GROUPS:
        raise ExportError(f"group size {group_size} is not supported; use one of {', '.join(map(str, GROUPS))} "
                          "(--group-size)")
    if jobs is not None and not (isinstance(jobs, int) and jobs >= 1):
        raise ExportError(f"jobs={jobs!r} must be a positive number of compile workers (--jobs); 1 compiles the "
                          "methods one after another")
    bar = _Progress(0, False)
    clock = _Clock(timings)
    pool, workers = workers, None  # the caller's pool; the workers this export compiles in
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        progress_note(f"reading {source if not isinstance(source, ModelSource) else source.name} ...", progress)
        # a GGUF's expert stacks that stay packed are read without float copies unless the export dequantizes
        src = resolve_source(source, lazy_experts=not dequantize and quantize is None)
        bound = src.config.max_target_positions if src.family == "whisper" else src.config.max_position_embeddings
        if max_seq_len is None:
            max_seq_len = bound if src.family == "whisper" else min(2048, bound)
        if not 1 <= max_seq_len <= (bound if src.family == "whisper" else 1 << 20):
            raise ExportError(f"max_seq_len={max_seq_len} is out of range for {src.name}; "
                              f"use 1..{bound} (--max-seq-len)")
        if dequantize is None:
            dequantize = False
        if quantize is not None and src.packed and not dequantize:
            raise ExportError(f"{src.name} is already quantized ({_gguf_types(src)}) and stays so; to quantize it "
                              f"again to {quantize}, pass dequantize=True too (--dequantize)")
        model = src.build(max_seq_len, dtype, device, quantize=(quantize, group_size) if quantize is not None else None)
        sources = _pack(model, src, dequantize, quantize, group_size, progress)
        if sources and device == "cuda" and native_kernels and native.linear_serves(device):
            order_tiles(model)  # the native decode kernel's tile order (the manifest names the _mma layouts)
            native.load()  # its ops exist before any method that calls them is traced
        if hasattr(model, "paged_state"):  # the families whose KV can be paged
            model.kv_block = kv_block
        if kv_storage is not None:
            if not hasattr(model, "kv_dtype"):
                raise ExportError(f"kv_dtype={kv_dtype!r}: an 8-bit KV cache is built for the Llama family, not "
                                  f"{src.family}; export {src.name} without --kv-dtype")
            model.kv_dtype = kv_storage
        if hasattr(model, "native_kernels"):
            model.native_kernels = native_kernels
        available = model.export_methods(max_seq_len, device)
        methods = list(available) if methods is None else list(methods)
        unknown = sorted(set(methods) - set(available)) + sorted(set(embed_weights) - set(methods))
        if unknown or not methods:
            raise ExportError(f"cannot export methods {unknown or methods}: {src.family} models have "
                              f"{', '.join(available)} (embed_weights must name exported methods)")
        bar = _Progress(2 * len(methods) + 3, progress)
        bar.done()  # the source is read
        clock.lap("read and build")
        (tmp / "methods").mkdir(parents=True)
        cxx = pick_cxx()
        n_jobs = compile_jobs(jobs, len(methods))
        own = pool is None or jobs == 1 or (bool(pool.workers) and not pool.serves_this_process())
        if own:
            workers = CompileWorkers(n_jobs) if n_jobs > 1 else None  # they start up while the methods are traced
        else:
            workers = pool
            workers.start()  # (running already, or started now)
            n_jobs = workers.n
        declared = set(model.state_fqns())
        configs = {name: _inductor_configs(cxx, name in embed_weights, device) for name in methods}
        weights = None
        if workers is not None and device == "cpu":
            # CPU weights go to the workers by name in the weights file (mapped, not copied): write it first.
            weights = _write_weights(tmp, model)
            clock.lap("write weights")
        exported, libraries = {}, {}
        where = {name: "in the exporting process" for name in methods}
        # every method is traced (and checked) before the export goes on; with workers, the longest compile first
        for name in trace_order(methods, available) if workers is not None else methods:
            bar.step(f"export {name}")
            with native.use(native_kernels):  # the projections' native kernels, or never (the comparison)
                exported[name] = _export_method(available[name], name, declared)
            ep = exported[name][0]
            libraries[name] = op_libraries(ep, (NATIVE_LIBRARY, CPU_LIBRARY))
            clock.lap(f"trace {name}")
            if workers is not None:  # it compiles while the next is traced (a failed check below kills it)
                try:
                    task = make_task(name, ep, _package(tmp, name), configs[name], libraries[name],
                                     weights and {k: v for k, (v, _) in weights.items()},
                                     tmp / WEIGHTS if weights else None, n_jobs)
                except Exception as e:  # torch.export.save cannot write it (2.13: a program without outputs)
                    where[name] = f"in the exporting process: not serializable ({type(e).__name__}: {e})"[:300]
                else:
                    workers.submit(task)
                    where[name] = "in a worker"
                clock.lap(f"send {name}")
            bar.done()
        written = {f for _, writes in exported.values() for f in writes}
        if written != declared and set(methods) == set(available):
            raise ExportError(f"the methods never write the declared state {sorted(declared - written)[:4]}; "
                              "refusing to write a bundle whose state declaration is wrong")
        compiled = {}
        for name in methods:  # in this process: all (jobs=1), or what no worker could take
            if where[name] != "in a worker":
                bar.step(f"compile {name}")
                compiled[name] = _compile(exported[name][0], name, tmp, configs[name])
                bar.done()
        if workers is not None:
            if weights is None:  # CUDA: while the workers compile
                weights = _write_weights(tmp, model)
                clock.lap("write weights")
            left = [name for name in methods if name not in compiled]

            def finished(name: str) -> None:
                left.remove(name)
                bar.done()
                if left:
                    bar.step(f"compile {', '.join(left)}")

            if left:
                bar.step(f"compile {', '.join(left)}")
            compiled.update(workers.wait(finished))
            if own:
                workers.close()
        clock.lap("compile", {name: {"seconds": c.seconds, "received": c.received, "where": where[name],
                                     "inductor": c.phases} for name, c in compiled.items()})
        specs = {name: _method_spec(available[name], name, tmp, name in embed_weights, exported[name][1],
                                    compiled[name], libraries[name]) for name in methods}
        bar.step("write bundle")
        if weights is None:
            weights = _write_weights(tmp, model)
            clock.lap("write weights")
        _write_bundle(tmp, src, model, specs, max_seq_len, dtype, device, cxx, sources, weights)
        bar.done()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        clock.lap("write bundle")
        bar.step("done")
        bar.done()
        return out
    except BaseException:
        if workers is not None:
            workers.close(kill=True)  # before the partial bundle goes: nothing writes into it afterwards
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
        clock.done()


def _check_fp8_device(device: str, option: str) -> None:
    """Raise unless ``option``='fp8' (``kv_dtype`` or ``quantize``) can run on ``device``: CUDA needs float8
    conversions and FP8 tensor cores, compute capability 8.9 or newer; the CPU emulates them."""
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        raise ExportError(f"{option}='fp8' needs a GPU of compute capability 8.9 or newer (Ada, Hopper), this one is "
                          f"{'.'.join(map(str, torch.cuda.get_device_capability()))}; use {option}='int8' "
                          f"(--{option.replace('_', '-')} int8)")


def _gguf_types(src: ModelSource) -> str:
    """The quantized source's types (GGUF's Q4_K ..., or GPTQ int4 g128 ...), for messages."""
    return ", ".join(sorted({p.qtype for p in src.packed.values()}))


def _pack(model: torch.nn.Module, src: ModelSource, dequantize: bool, quantize: str | None, group_size: int,
          progress: bool) -> dict[str, str]:
    """Put the packed layers in place (see `export`); returns layer -> where its packing came from."""
    if quantize is not None:
        quantize_model(model, quantize, group_size)
        return {name: f"{quantize} rtn" for name in packed_layers(model)}
    if not src.packed or dequantize:
        return {}
    # a source read without the packed experts' floats was packed as it was built
    sources, kept_float = getattr(model, "gguf_packing", None) or pack_gguf(model, src.packed)
    if kept_float:
        progress_note(f"kept float (fused parts quantized unlike, or values the packing cannot rearrange): "
                      f"{', '.join(kept_float[:4])}"
                      f"{' ...' if len(kept_float) > 4 else ''}", progress)
    return sources


def _export_method(method: MethodDef, name: str, declared: set[str]) -> tuple[torch.export.ExportedProgram, set[str]]:
    """torch.export one method; returns it and the state FQNs it writes in place.

    Every in-place write must land in a declared state pool passed as an input: a write into a
    constant (a buffer) would be shared by every session, and a write into another input is a bug.
    """
    undeclared = sorted(set(method.state) - declared)
    if undeclared:
        raise ExportError(f"method {name!r} takes state {undeclared[:4]} beyond the declared state; "
                          "refusing to write a bundle whose sessions would share state")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(method.module, method.args, dynamic_shapes=method.dynamic_shapes, strict=False)
        # torch keeps in-place writes in the graph: read them off it (`written_inputs`), or, for a graph that
        # calls what that does not see through, off the signature of the functionalized (decomposed) program.
        found = written_inputs(ep)
        if found is None:
            sig = ep.run_decompositions().graph_signature
            found = (sig.user_inputs, list(sig.user_inputs_to_mutate.values()), list(sig.buffers_to_mutate.values()))
    user_inputs, written_users, written_constants = found
    if written_constants:
        raise ExportError(f"method {name!r} mutates the buffers {sorted(written_constants)[:4]} in place; "
                          "state must be declared and passed as a pool (state_specs), or sessions would share it")
    n_user = len(method.args) - len(method.state)  # user inputs and rows come first, then the pools
    writes = set()
    for input_name in written_users:
        i = user_inputs.index(input_name)
        if i < n_user:
            raise ExportError(f"method {name!r} writes into its input #{i} in place; only state pools may be written")
        writes.add(method.state[i - n_user])
    return ep, writes


def written_inputs(ep: torch.export.ExportedProgram) -> tuple[list[str], list[str], list[str]] | None:
    """The inputs ``ep`` writes in place, read off its (not functionalized) graph: (the user inputs' names in
    order, the user inputs written, the parameters/buffers written), as the signature of
    ``ep.run_decompositions()`` names them (`tests/test_export_time.py` checks the two agree), without its
    trace of the whole program again (19-23 s a method for SmolLM2 on 2 cores).

    An operator writes the arguments its schema marks ``(a!)``; an argument is an input's memory when its
    traced value shares the input's storage (a view of it, at any depth); a ``torch.cond`` writes what its
    branches write of their operands. None when the graph calls something else whose writes no schema tells
    (another higher-order op, a Python callable taking tensors): then the caller asks functionalization.
    """
    from torch.export.graph_signature import InputKind

    found = _written_placeholders(ep.graph_module)
    if found is None:
        return None
    placeholders = [node.name for node in ep.graph.nodes if node.op == "placeholder"]
    written = {placeholders[i] for i in found}
    spec_of = {spec.arg.name: spec for spec in ep.graph_signature.input_specs if hasattr(spec.arg, "name")}
    users = list(ep.graph_signature.user_inputs)
    constants = [spec_of[n].target for n in written
                 if spec_of[n].kind in (InputKind.BUFFER, InputKind.PARAMETER, InputKind.CONSTANT_TENSOR)]
    return users, [n for n in users if n in written], constants


def _written_placeholders(gm: torch.fx.GraphModule) -> set[int] | None:
    """The positions of the placeholders ``gm``'s graph writes in place (`written_inputs`), or None."""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(node: object) -> StorageWeakRef | None:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None

    inputs: dict[StorageWeakRef, list[int]] = {}
    written: set[int] = set()

    def write(nodes: list) -> bool:  # False: a written value whose memory is not known
        for node in nodes:
            if (s := storage(node)) is None:
                return False
            written.update(inputs.get(s, ()))
        return True

    position = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if (s := storage(node)) is not None:
                inputs.setdefault(s, []).append(position)
            position += 1
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            for i, arg in enumerate(target._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    if not write(_flat_nodes(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))):
                        return None
        elif target is torch.ops.higher_order.cond and len(node.args) == 4 and not node.kwargs:
            _, *branches, operands = node.args  # cond(pred, true_fn, false_fn, operands)
            for branch in branches:
                inner = _written_placeholders(gm.get_submodule(branch.target)) if isinstance(branch, torch.fx.Node) else None
                if inner is None or not write([operands[i] for i in inner]):
                    return None
        elif target is not operator.getitem and any(storage(a) is not None for a in _flat_nodes((node.args, node.kwargs))):
            return None  # takes tensors, writes who knows what
    return written


def _flat_nodes(value: object) -> list[torch.fx.Node]:
    """The fx nodes in a (nested) argument."""
    if isinstance(value, torch.fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _flat_nodes(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _flat_nodes(v)]
    return []


# AOTInductor settings for a weightless package: every parameter stays a named constant the runtime
# binds from the weight store (user-managed), none is baked into the .so.
EXTERNAL_WEIGHTS = {"always_keep_tensor_constants": True, "aot_inductor.package_constants_in_so": False}


# The CUDA wrapper is host code that launches the kernels; decode replays it as a CUDA graph, so its
# optimisation level does not reach a decode step, but compiling a 32-layer wrapper at -O1 took 45 s of each
# method's compile (llama3-8b on the H100 machine). $AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL still decides, in the
# exporting process and its compile workers alike (the CPU wrapper's -O1 is worth 4-5% of a CPU decode step).
WRAPPER_OPT_ENV = "AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL"


def _inductor_configs(cxx: str, embed: bool, device: str) -> dict[str, Any]:
    from torch._inductor import config as inductor_config

    configs: dict[str, Any] = {"cpp.cxx": (cxx,)}
    if not embed:
        configs.update(EXTERNAL_WEIGHTS)
    level = os.environ.get(WRAPPER_OPT_ENV) or ("O0" if device == "cuda" else None)
    if level:
        configs["aot_inductor.compile_wrapper_opt_level"] = level
    # Line tables (-g1 on every g++ call, the wrapper's and the CPU kernels') only serve profilers that symbolize
    # generated code, and took 2 of a 2-layer method's 8 s wrapper compile and 0.4 of its 1.5 s kernels (2 cores)
    if hasattr(inductor_config.aot_inductor, "enable_line_tables"):
        configs["aot_inductor.enable_line_tables"] = False
    return configs


def trace_order(methods: Sequence[str], defs: dict[str, MethodDef]) -> list[str]:
    """The order to trace ``methods`` in when workers compile each as soon as it is traced: the longest
    compile first, so it starts earliest and the others' traces overlap it: batch-invariant methods first,
    prefill last. Measured (llama3-8b, H100 machine, traced prefill first): trace 16 / 32 / 40 s and compile
    142 / 162 / 193 s for prefill / decode / decode_invariant; the last compile started at 103 s."""
    return sorted(methods, key=lambda name: (not defs[name].batch_invariant, defs[name].role == "prefill"))


def _package(tmp: Path, name: str) -> Path:
    return tmp / "methods" / f"{name}.pt2"


def _compile(ep: torch.export.ExportedProgram, name: str, tmp: Path, configs: dict[str, Any]) -> Compiled:
    """Compile one method in this process; a failure is an ExportError naming it."""
    try:
        return compile_package(ep, _package(tmp, name), configs)
    except OnecopyError:
        raise
    except Exception as e:
        raise ExportError(f"compiling method {name!r} failed: {type(e).__name__}: {e}") from e


def _method_spec(method: MethodDef, name: str, tmp: Path, embed: bool, writes: set[str], compiled: Compiled,
                 native_ops: list[str]) -> MethodSpec:
    pkg = _package(tmp, name)
    return MethodSpec(name=name, package=f"methods/{name}.pt2", package_sha256=sha256(pkg.read_bytes()),
                      weights="embedded" if embed else "external", inputs=method.inputs, constants=compiled.constants,
                      state=list(method.state), writes=sorted(writes), role=method.role,
                      batch_invariant=method.batch_invariant, paged=method.paged, native_ops=native_ops)


def op_libraries(ep: torch.export.ExportedProgram, libraries: Sequence[str]) -> list[str]:
    """Which of ``libraries`` (op namespaces) the program calls: the package will call them by name, so the
    runtime must load them first. Ops that write their inputs sit inside an auto_functionalized node."""
    found = set()
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        for target in (node.target, *(a for a in node.args[:1] if isinstance(a, torch._ops.OpOverload))):
            if isinstance(target, torch._ops.OpOverload) and target.namespace in libraries:
                found.add(target.namespace)
    return sorted(found)


def _write_weights(tmp: Path, model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, str]]:
    """Write the weight file; returns name -> (the CPU tensor written, its sha256)."""
    from safetensors.torch import save_file

    tensors = model.state_dict()  # tied weights appear once: the models reuse the embedding, no alias FQN
    weights = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(weights, str(tmp / WEIGHTS))
    digests = sha256_many([tensor_view(v) for v in weights.values()])
    return {k: (v, digest) for (k, v), digest in zip(weights.items(), digests)}


def _write_bundle(tmp: Path, src: ModelSource, model: torch.nn.Module, specs: dict[str, MethodSpec], max_seq_len: int,
                  dtype: torch.dtype, device: str, cxx: str, sources: dict[str, str],
                  weights: dict[str, tuple[torch.Tensor, str]]) -> None:
    recurrent = set(getattr(model, "recurrent_state", list)())
    paged = set(getattr(model, "paged_state", list)())
    state = {k: TensorSpec(shape=list(shape), dtype=dtype_name(dt), init="zeros", recurrent=k in recurrent,
                           paged=True if k in paged else None)
             for k, (shape, dt) in model.state_specs().items()}
    (tmp / TOKENIZER).write_text(src.tokenizer_json)
    manifest = Manifest(
        family=src.family, config=src.config.to_dict(), max_seq_len=max_seq_len, dtype=dtype_name(dtype),
        device_kind=device, methods=specs,
        weights={k: TensorSpec(shape=list(v.shape), dtype=dtype_name(v.dtype), sha256=digest)
                 for k, (v, digest) in weights.items()},
        state=state,
        tokenizer={"file": TOKENIZER, "bos_token_id": src.bos_token_id},
        generation={"eos_token_ids": src.eos_token_ids, "chat_template": src.chat_template, **src.generation},
        build={"source": src.name, "torch": torch.__version__, "cxx": cxx,
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        format_version=FORMAT_VERSION, kv_block_size=getattr(model, "kv_block", None) if paged else None,
        packed=packed_layers(model, sources))
    (tmp / MANIFEST).write_text(manifest.to_json())
