"""Compile an export's methods side by side, each in a worker process (`export(jobs=...)`).

A method's AOTInductor compile (AOT autograd's trace, Inductor's lowering and scheduling, the kernel and wrapper
compiles, the packaging) is independent of the others' and mostly single-threaded Python, so the methods of
one export compile in parallel in separate processes, a method as soon as it is traced (while the next one
is). ``jobs`` bounds the workers (default: one per CPU, at most one per method); ``jobs=1`` (--jobs 1,
$ONECOPY_EXPORT_JOBS=1) compiles them one after another in the exporting process, as before.

Workers are fresh interpreters (``python -c`` `_WORKER_MAIN`, as Inductor starts its own compile workers):
the exporting process may hold CUDA, which a forked child cannot use, and a script without a ``__main__``
guard is not run again. They import onecopy, which defines the Triton ops (`kernels.ops`); a task names the
other op libraries its program calls (`kernels.native`, `kernels.cpu`), loaded before the program is read. They share
Inductor's and Triton's on-disk caches with the exporting process (same user, same environment): a kernel
one method compiled is reused by the others and by later exports.

What goes to a worker: the ExportedProgram as `torch.export.save` bytes with every tensor (parameters,
buffers, constants, example inputs) replaced by a meta tensor, and the tensors apart: CUDA ones through CUDA
IPC (torch.multiprocessing's reductions: the worker maps the exporting process's memory, nothing is copied),
CPU ones that are bundle weights by name in the bundle's weights.safetensors (mapped copy-on-write: the page
cache is shared), other CPU ones by value. The worker puts them back and compiles the same program; the
package differs from an in-process compile's at most in Inductor's names for equal shape symbols. A method
whose program cannot be sent (torch 2.13 cannot save one without outputs: Whisper's encoder) is compiled by
the exporter itself once every method is traced, beside the workers.

Failures are typed: a method that fails to compile, or a worker that dies, raises ExportError naming the
method; every worker (and what it started: its own process group) is killed before the exporter removes its
partial bundle, and a worker whose exporting process died kills itself.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ExportError, OnecopyError

JOBS_ENV = "ONECOPY_EXPORT_JOBS"  # workers for the methods' compiles; 1: compile them one after another here


def compile_jobs(jobs: int | None, n_methods: int) -> int:
    """How many methods compile at once: ``jobs``, else $ONECOPY_EXPORT_JOBS, else one per CPU this process
    may run on; at most one per method. 1 compiles in this process, one method after another."""
    if jobs is None:
        env = os.environ.get(JOBS_ENV, "").strip()
        if env:
            try:
                jobs = int(env)
            except ValueError:
                raise ExportError(f"{JOBS_ENV}={env!r} is not a number of compile workers; use 1 to compile the "
                                  "methods one after another") from None
        else:
            jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not isinstance(jobs, int) or jobs < 1:
        raise ExportError(f"jobs={jobs!r} must be a positive number of compile workers (--jobs); 1 compiles the "
                          "methods one after another")
    return max(1, min(jobs, n_methods))


@dataclass
class Compiled:
    """What compiling one method gave besides its package."""

    constants: list[str]  # the FQNs the package reads, as its get_constant_fqns() lists them
    seconds: float  # aoti_compile_and_package's wall time
    phases: dict[str, float] = field(default_factory=dict)  # Inductor's own timers during it (seconds, summed)
    received: float = 0.0  # in a worker: seconds to read the program and put its tensors back, before compiling


def compile_package(ep: torch.export.ExportedProgram, package: Path, configs: dict[str, Any]) -> Compiled:
    """AOTI-compile ``ep`` into ``package`` with ``configs``; here or in a worker."""
    from torch._dynamo.utils import compilation_time_metrics

    before = {k: sum(v) for k, v in compilation_time_metrics.items()}
    start = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._inductor.aoti_compile_and_package(ep, package_path=str(package), inductor_configs=dict(configs))
    seconds = time.perf_counter() - start
    # What the compiled package really reads (unused parameters are dropped), not the signature.
    constants = package_constants(package)
    if constants is None:  # a wrapper this torch writes differently: ask the loaded package
        constants = torch._inductor.aoti_load_package(str(package)).get_constant_fqns()
    phases = {k: round(sum(v) - before.get(k, 0.0), 3) for k, v in compilation_time_metrics.items()}
    return Compiled(sorted(constants), round(seconds, 3), {k: v for k, v in phases.items() if v > 0})


_MODEL_BASE = b"AOTInductorModelBase("
_FQN = b".original_fqn = \""


def package_constants(package: Path) -> list[str] | None:
    """The FQNs of the constants an AOTI package reads, as its loaded model's ``get_constant_fqns()`` lists
    them, read from the generated wrapper source the package carries (``constants_info_[i].original_fqn =
    "..."``, one line per constant) instead of loading it (a dlopen, and on CUDA a context and the kernels).
    None unless exactly one source declares the model, with its constant count, and names each constant once."""
    import re
    import zipfile

    base = re.compile(rb"AOTInductorModelBase\(\s*(\d+),\s*(\d+),\s*(\d+),")
    line = re.compile(rb'constants_info_\[(\d+)\]\.original_fqn = "([^"\\]*)";')
    found = None
    with zipfile.ZipFile(package) as z:
        for entry in z.namelist():
            if not entry.endswith(".cpp"):
                continue
            text = z.read(entry)
            if _MODEL_BASE not in text:
                continue
            declared = base.search(text)
            if found is not None or declared is None:
                return None
            named = line.findall(text)
            n = int(declared.group(3))
            by_index = {int(i): fqn.decode() for i, fqn in named}
            if len(named) != n or set(by_index) != set(range(n)) or text.count(_FQN) != n:
                return None
            found = [by_index[i] for i in range(n)]
    return found


# -- what goes to a worker ------------------------------------------------------------------------------------

@dataclass
class Task:
    """One method to compile, and how to rebuild its program's tensors (see the module docstring)."""

    name: str
    package: str
    configs: dict[str, Any]
    libraries: list[str]  # op libraries (`kernels.native`) to load before reading the program
    program: bytes  # torch.export.save of the program, its tensors meta
    refs: dict[str, tuple]  # slot -> ("file", weight name) | ("value", i) | ("ipc", i), and requires_grad
    values: bytes  # torch.save of the CPU tensors sent by value (a plain pickle cannot load float8 ones)
    ipc: bytes  # torch.multiprocessing pickle of the CUDA tensors
    weights_file: str | None
    inductor_config: bytes  # the exporting process's Inductor config (torch._inductor.config.save_config)
    compile_threads: int  # Inductor's kernel-compile processes for this worker: its share of the CPUs
    gpu_lock: str | None = None  # a file the workers lock around each GPU benchmark (`_benchmark_alone`)


def _slots(ep: torch.export.ExportedProgram) -> tuple[dict[str, torch.Tensor], Any]:
    """Every tensor of ``ep`` by a slot name: s:<state_dict key>, c:<constant>, x:<example input leaf>."""
    from torch.utils import _pytree as pytree

    slots = {f"s:{k}": v for k, v in ep.state_dict.items()}
    slots.update({f"c:{k}": v for k, v in ep.constants.items() if isinstance(v, torch.Tensor)})
    leaves, spec = pytree.tree_flatten(ep.example_inputs)
    slots.update({f"x:{i}": v for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)})
    return slots, (leaves, spec)


def _rebuilt(ep: torch.export.ExportedProgram, slots: dict[str, torch.Tensor]) -> torch.export.ExportedProgram:
    """``ep`` with the tensor in each slot replaced (parameters stay parameters)."""
    from torch.utils import _pytree as pytree

    def param(k: str, old: torch.Tensor) -> torch.Tensor:
        t = slots[f"s:{k}"]
        return torch.nn.Parameter(t, requires_grad=old.requires_grad) if isinstance(old, torch.nn.Parameter) else t

    state_dict = {k: param(k, v) for k, v in ep.state_dict.items()}
    constants = {k: slots.get(f"c:{k}", v) for k, v in ep.constants.items()}
    leaves, spec = pytree.tree_flatten(ep.example_inputs)
    example = pytree.tree_unflatten([slots.get(f"x:{i}", v) for i, v in enumerate(leaves)], spec)
    return torch.export.ExportedProgram(
        root=ep.graph_module, graph=ep.graph, graph_signature=ep.graph_signature, state_dict=state_dict,
        range_constraints=ep.range_constraints, module_call_graph=ep.module_call_graph, example_inputs=example,
        constants=constants, verifiers=ep.verifiers)


def make_task(name: str, ep: torch.export.ExportedProgram, package: Path, configs: dict[str, Any],
              libraries: list[str], weights: dict[str, torch.Tensor] | None, weights_file: Path | None,
              workers: int = 1) -> Task:
    """Pack ``ep`` for one of ``workers`` workers; ``weights`` (name -> the CPU tensor written to
    ``weights_file``) lets CPU tensors that are weights go by name."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the CUDA IPC reductions)

    slots, _ = _slots(ep)
    by_memory = {(t.data_ptr(), t.dtype, tuple(t.shape), t.stride()): k for k, t in (weights or {}).items()
                 if t.device.type == "cpu"}
    refs: dict[str, tuple] = {}
    values: list[torch.Tensor] = []
    shared: list[torch.Tensor] = []
    for slot, t in slots.items():
        t = t.detach()
        if t.device.type == "cpu":
            weight = by_memory.get((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()))
            # Inductor writes each constant's storage offset and size into the package: only a tensor that is
            # its whole storage is rebuilt as one from the file; a view goes by value, with its storage.
            whole = t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
            if weight is not None and weights_file is not None and whole:
                refs[slot] = ("file", weight)
            else:
                refs[slot] = ("value", len(values))
                values.append(t)
        else:
            refs[slot] = ("ipc", len(shared))
            shared.append(t)
    meta = {slot: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for slot, t in slots.items()}
    buf = io.BytesIO()
    try:
        torch.export.save(_rebuilt(ep, meta), buf)
    finally:
        ep.graph.owning_module = ep.graph_module  # the copy took the graph over; ``ep`` stays as it was
    return Task(name=name, package=str(package), configs=dict(configs), libraries=list(libraries),
                program=buf.getvalue(), refs=refs, values=_saved(values),
                ipc=bytes(ForkingPickler.dumps(shared)) if shared else b"",
                weights_file=str(weights_file) if weights_file is not None else None,
                inductor_config=torch._inductor.config.save_config(),
                compile_threads=-(-(torch._inductor.config.compile_threads or 1) // workers))


def _saved(tensors: list[torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


_MAPS: list = []  # the weight files' mappings, alive as long as the tensors made from them


def _weights_views(path: str, names: set[str]) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file, each on its own storage (as the exporter's are: `make_task`), mapped
    copy-on-write: nothing is copied, and the page cache is shared with the exporting process."""
    import mmap

    from ..bundle import _ST_DTYPES

    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    _MAPS.append(mm)
    out = {}
    for name in names:
        entry = header[name]
        dtype = _ST_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        count = (end - begin) // dtype.itemsize
        t = torch.frombuffer(mm, dtype=dtype, count=count, offset=8 + n + begin) if count else torch.empty(0, dtype=dtype)
        out[name] = t.view(entry["shape"])
    return out


def run_task(task: Task) -> Compiled:
    """Rebuild the task's program and compile it (in a worker)."""
    if task.libraries:
        from ..kernels import cpu, native  # importing kernels.cpu defines its op (compiling needs no C++ build)

        if native.LIBRARY in task.libraries:
            native.load()
        assert set(task.libraries) <= {native.LIBRARY, cpu.LIBRARY}, task.libraries
    start = time.perf_counter()
    if task.gpu_lock and torch.cuda.is_available():
        _benchmark_alone(task.gpu_lock)
    torch._inductor.config.load_config(task.inductor_config)
    # The exporter's Triton/C++ compile processes, shared out: the workers compile side by side.
    torch._inductor.config.compile_threads = task.compile_threads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        light = torch.export.load(io.BytesIO(task.program))
    values = torch.load(io.BytesIO(task.values), weights_only=True)
    shared = pickle.loads(task.ipc) if task.ipc else []
    by_name = {r[1] for r in task.refs.values() if r[0] == "file"}
    # Only tensors sent by name read the weights file: on CUDA it is written while the workers compile.
    mapped = _weights_views(task.weights_file, by_name) if by_name else {}
    slots = {slot: mapped[x] if kind == "file" else values[x] if kind == "value" else shared[x]
             for slot, (kind, x) in task.refs.items()}
    ep = _rebuilt(light, slots)
    received = time.perf_counter() - start
    compiled = compile_package(ep, Path(task.package), task.configs)
    compiled.received = round(received, 3)
    return compiled


def _benchmark_alone(lock: str, benchmarker: Any = None) -> None:
    """Time GPU kernels with no other worker's on the GPU: Inductor benchmarks the configs of the kernels it
    autotunes while compiling, and two processes' kernels time-slice the one GPU, which would skew the
    choice. Each benchmark (Inductor's ``benchmarker``; calls nested in one are inside its lock) holds an
    exclusive lock on ``lock``, a file all the export's workers open; the rest of the compiles (lowering,
    kernel and wrapper compiles) still runs side by side."""
    import fcntl
    import threading

    if benchmarker is None:
        try:
            from torch._inductor.runtime.benchmarking import benchmarker
        except ImportError:
            return
    if getattr(benchmarker, "_onecopy_alone", False):
        return
    held = threading.local()

    def alone(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(held, "file", None) is not None:  # nested (a CUDA-graph benchmark times its replay)
                return fn(*args, **kwargs)
            with open(lock, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                held.file = f
                try:
                    return fn(*args, **kwargs)
                finally:
                    held.file = None  # closing the file releases the lock
        return call

    for name in ("benchmark_gpu", "benchmark_gpu_with_cuda_graph"):
        if hasattr(benchmarker, name):
            setattr(benchmarker, name, alone(getattr(benchmarker, name)))
    benchmarker._onecopy_alone = True


# -- the workers ----------------------------------------------------------------------------------------------

class _WorkerTraceback(Exception):
    """The traceback of a failure in a compile worker (the ExportError's cause)."""


@dataclass
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    task: str | None = None


def _worker_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])  # the directory holding this onecopy package
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))


# Variables that say nothing about a compile (pytest names the running test in this one)
_ENV_IGNORED = frozenset({"PYTEST_CURRENT_TEST"})


class CompileWorkers:
    """``n`` compile worker processes (they import torch and Inductor while the exporter traces).

    An export starts its own and stops them. A caller that exports many bundles may own a pool instead and pass
    it to each export (``onecopy.export(..., workers=pool)``; ``start=False`` starts the processes at the first
    export that uses them): each fresh worker costs ~7 s of CPU to import torch and Inductor, and more to warm
    up. The caller closes it (``with CompileWorkers(n, start=False) as pool:``)."""

    def __init__(self, n: int, *, start: bool = True) -> None:
        self.n = n
        self.env: dict[str, str] = {}
        self.workers: list[_Worker] = []
        self.idle: list[_Worker] = []
        self.gpu_lock = Path(tempfile.gettempdir()) / f"onecopy-export-{os.getpid()}-{id(self):x}.gpu.lock"
        self.pending: list[Task] = []
        self.busy: dict[Connection, _Worker] = {}
        if start:
            self.start()

    def __enter__(self) -> "CompileWorkers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the workers (if not running already) with this process's environment."""
        if self.workers:
            return
        self.env = _worker_env()
        try:
            for _ in range(self.n):
                ours, theirs = socket.socketpair()
                with ours, theirs:
                    proc = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN, str(theirs.fileno())],
                                            pass_fds=(theirs.fileno(),), env=self.env, stdin=subprocess.DEVNULL,
                                            start_new_session=True)  # its own process group: killed as one
                    self.workers.append(_Worker(proc, Connection(os.dup(ours.fileno()))))
        except BaseException:
            self.close(kill=True)
            raise
        self.idle = list(self.workers)

    def serves_this_process(self) -> bool:
        """Whether running workers compile as a fresh one would now: alive and started under this process's
        environment as it is (a variable such as ATEN_CPU_CAPABILITY changes what Inductor writes)."""
        now = _worker_env()
        return (all(w.proc.poll() is None for w in self.workers) and not self.pending and not self.busy
                and {k: v for k, v in self.env.items() if k not in _ENV_IGNORED}
                == {k: v for k, v in now.items() if k not in _ENV_IGNORED})

    def submit(self, task: Task) -> None:
        """Queue a method; it starts at once if a worker is free."""
        task.gpu_lock = str(self.gpu_lock)
        self.pending.append(task)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.pending and self.idle:
            worker = self.idle.pop()
            task = self.pending.pop(0)
            worker.task = task.name
            try:
                worker.conn.send_bytes(pickle.dumps(task))
            except OSError:
                raise self._died(worker) from None
            self.busy[worker.conn] = worker

    def wait(self, on_done: Callable[[str], None]) -> dict[str, Compiled]:
        """Wait for every method submitted; returns name -> Compiled. Raises ExportError naming the first
        method that fails (the others are left to `close`)."""
        done: dict[str, Compiled] = {}
        while self.pending or self.busy:
            self._dispatch()
            for conn in wait(list(self.busy)):
                worker = self.busy.pop(conn)
                try:
                    status, name, result, detail = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    raise self._died(worker) from None
                if status != "ok":
                    raise ExportError(f"compiling method {name!r} failed: {result}") from _WorkerTraceback(detail)
                done[name] = result
                worker.task = None
                self.idle.append(worker)
                on_done(name)
        return done

    def _died(self, worker: _Worker) -> ExportError:
        try:
            code = worker.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return ExportError(f"the worker compiling method {worker.task!r} died ({how}); nothing was written. Rerun with "
                           f"{JOBS_ENV}=1 (--jobs 1) to compile in this process and see the error")

    def close(self, kill: bool = False) -> None:
        """Stop the workers: they exit when their connection closes; ``kill`` (or a worker that does not exit)
        kills its whole process group (Inductor's compile workers and compilers too). `start` may start them
        again."""
        self.pending, self.busy, self.idle = [], {}, []
        for w in self.workers:
            w.conn.close()
        for w in self.workers:
            if not kill:
                try:
                    w.proc.wait(timeout=60)
                    continue
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(w.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            w.proc.wait()
        self.workers = []
        self.gpu_lock.unlink(missing_ok=True)


def _serve(fd: int) -> None:
    """A worker: compile tasks from the connection until it closes."""
    import threading
    import traceback

    parent = os.getppid()

    def orphaned() -> None:  # the exporting process was killed: stop now, with what this worker started
        while os.getppid() == parent:
            time.sleep(1)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=orphaned, daemon=True).start()
    conn = Connection(fd)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        name = "?"
        try:
            task = pickle.loads(message)
            name = task.name
            reply = ("ok", name, run_task(task), "")
        except Exception as e:  # reported, typed, by the exporting process
            reply = ("error", name, f"{type(e).__name__}: {e}" if not isinstance(e, OnecopyError) else str(e),
                     traceback.format_exc())
        conn.send_bytes(pickle.dumps(reply))


# A worker's program. It imports this module by its name (what it pickles back must unpickle in the exporting
# process), and with it onecopy, which defines the ops the programs call (`kernels.ops`); and Inductor, while
# the exporter traces.
_WORKER_MAIN = """
import logging, sys, warnings
warnings.simplefilter("ignore")
# torch's "No CUDA runtime is found" warning (nvcc installed, no GPU) would reach the exporting command's stderr
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
import torch._inductor.compile_fx
from onecopy.export.compile_worker import _serve
_serve(int(sys.argv[1]))
"""
