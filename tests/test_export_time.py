"""The export's shortcuts give what the long way gave: the methods compiled in worker processes make the same
bundle as compiled one after another here; the mutated state read off the graph is what functionalization
names; the constants read off the package are what the loaded package lists. One extra tiny export (serial)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import onecopy
from onecopy.export import compile_worker, exporter
from onecopy.export.compile_worker import CompileWorkers, compile_jobs, package_constants
from onecopy.export.exporter import written_inputs
from onecopy.models.source import preset_source

from .conftest import TINY_MAX_SEQ_LEN

PROMPT = [1, 15, 27, 99, 3, 42, 7]


@pytest.fixture(scope="module")
def parallel_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory, tiny_source) -> Path:
    """The session's tiny bundle when it was compiled in workers (two or more CPUs), else one that is."""
    if compile_jobs(None, 2) > 1:
        return tiny_bundle
    return onecopy.export(tiny_source, tmp_path_factory.mktemp("par") / "tiny", max_seq_len=TINY_MAX_SEQ_LEN,
                          progress=False, jobs=2)


@pytest.fixture(scope="module")
def serial_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_source) -> Path:
    return onecopy.export(tiny_source, tmp_path_factory.mktemp("serial") / "tiny", max_seq_len=TINY_MAX_SEQ_LEN,
                          progress=False, jobs=1)


def _manifest(bundle: Path) -> dict:
    m = json.loads((bundle / "manifest.json").read_text())
    del m["build"]["created"]
    for spec in m["methods"].values():
        del spec["package_sha256"]  # packages may differ in bytes (Inductor's symbol names), not in behavior
    return m


def _greedy(bundle: Path, n: int = 12) -> list[int]:
    with onecopy.Engine.load(bundle) as engine:
        return list(engine.open_session().generate_ids(PROMPT, onecopy.SamplingParams(max_new_tokens=n), stop_ids=[]))


def test_parallel_compile_makes_the_serial_bundle(parallel_bundle, serial_bundle):
    par, ser = _manifest(parallel_bundle), _manifest(serial_bundle)
    assert par == ser  # methods (constants, writes, inputs ...), weights and their hashes, state, tokenizer
    assert list(par["methods"]) == list(ser["methods"])  # in the order asked for, whatever order they traced in
    assert _greedy(parallel_bundle) == _greedy(serial_bundle)


def test_constants_read_off_the_package_equal_get_constant_fqns(parallel_bundle, serial_bundle):
    for bundle in (parallel_bundle, serial_bundle):
        manifest = json.loads((bundle / "manifest.json").read_text())
        for name, spec in manifest["methods"].items():
            package = bundle / spec["package"]
            loaded = sorted(torch._inductor.aoti_load_package(str(package)).get_constant_fqns())
            assert sorted(package_constants(package)) == loaded == spec["constants"], name


def test_written_inputs_agree_with_the_decomposed_signature():
    """Read off the graph (no second trace) = what run_decompositions' signature names, for the tiny Llama's
    methods (paged KV: the bundles' default)."""
    model = preset_source("tiny-llama").build(TINY_MAX_SEQ_LEN, torch.float32, "cpu")
    model.kv_block = exporter.DEFAULT_KV_BLOCK
    for name, method in model.export_methods(TINY_MAX_SEQ_LEN, "cpu").items():
        ep = torch.export.export(method.module, method.args, dynamic_shapes=method.dynamic_shapes, strict=False)
        users, written, constants = written_inputs(ep)
        sig = ep.run_decompositions().graph_signature
        assert [users.index(n) for n in written] == sorted(sig.user_inputs.index(n)
                                                           for n in sig.user_inputs_to_mutate.values()), name
        assert written and constants == list(sig.buffers_to_mutate.values()) == []


class _Writes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(2))

    def forward(self, x, pool, other):
        pool[1:].select(0, 0).add_(x)  # through views of the input
        y = other.clone()
        y.mul_(2)  # a temporary: not an input write
        return y + x


class _WritesBuffer(_Writes):
    def forward(self, x, pool, other):
        self.count.add_(1)
        return x + pool + other


def test_written_inputs_follows_views_and_names_buffers():
    args = (torch.ones(4), torch.zeros(3, 4), torch.ones(4))
    ep = torch.export.export(_Writes(), args)
    users, written, constants = written_inputs(ep)
    assert [users.index(n) for n in written] == [1] and constants == []
    ep = torch.export.export(_WritesBuffer(), args)
    assert written_inputs(ep)[2] == ["count"]


class _Cond(torch.nn.Module):
    """A write into a pool, and a torch.cond on a symbolic size (as the CUDA decode's projections take)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x, pool):
        pool[1:].select(0, 0).copy_(x[0])
        return torch.cond(x.shape[0] <= 2, lambda x, w, p: (x @ w + p[0]).relu(), lambda x, w, p: x @ w.t() - p[0],
                          (x, self.w, pool))


def _cond_program() -> torch.export.ExportedProgram:
    with torch.no_grad():
        return torch.export.export(_Cond(), (torch.randn(3, 4), torch.zeros(3, 4)),
                                   dynamic_shapes=({0: torch.export.Dim("b", min=1, max=64)}, None), strict=False)


def test_written_inputs_sees_through_torch_cond():
    ep = _cond_program()
    assert any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in ep.graph.nodes)
    users, written, constants = written_inputs(ep)
    sig = ep.run_decompositions().graph_signature
    assert written == list(sig.user_inputs_to_mutate.values()) == ["pool"] and constants == []


def test_a_program_sent_to_a_worker_compiles_to_the_same_results(tmp_path):
    """make_task / run_task (here, in-process): the program through torch.export.save with meta tensors, its
    tensors apart, put back, compiled; a torch.cond's subgraphs too."""
    from onecopy.export.compile_worker import make_task, run_task
    from onecopy.toolchain import pick_cxx

    ep = _cond_program()
    # The weights file named but not written yet (CUDA: it is written while the workers compile): a task that
    # sends nothing by name must not read it.
    task = make_task("m", ep, tmp_path / "m.pt2", {"cpp.cxx": (pick_cxx(),)}, [], None, tmp_path / "later.safetensors")
    assert torch.export.load(io.BytesIO(task.program)).state_dict["w"].is_meta  # the tensors travel apart
    assert {kind for kind, _ in task.refs.values()} == {"value"}  # CPU, no weight file: by value
    compiled = run_task(task)
    assert compiled.seconds > 0 and compiled.constants == ["w"]
    package = torch._inductor.aoti_load_package(str(tmp_path / "m.pt2"))
    module = ep.module()
    for rows in (1, 5):
        x = torch.randn(rows, 4)
        want_pool, got_pool = torch.zeros(3, 4), torch.zeros(3, 4)
        torch.testing.assert_close(package(x, got_pool), module(x, want_pool))
        torch.testing.assert_close(got_pool, want_pool)


def test_gpu_benchmarks_of_the_workers_take_turns(tmp_path):
    """Each benchmark holds the export's lock file (other workers wait), a nested one does not wait for itself."""
    import fcntl

    lock = tmp_path / "gpu.lock"

    def lock_is_held() -> bool:
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False

    class Benchmarker:  # the shape of Inductor's: the CUDA-graph benchmark times its replay with benchmark_gpu
        def benchmark_gpu(self, fn):
            return fn()

        def benchmark_gpu_with_cuda_graph(self, fn):
            return self.benchmark_gpu(fn)

    bench = Benchmarker()
    compile_worker._benchmark_alone(str(lock), bench)
    assert bench.benchmark_gpu(lock_is_held) and bench.benchmark_gpu_with_cuda_graph(lock_is_held)
    assert not lock_is_held()


def test_the_longest_compile_is_traced_first():
    defs = {name: SimpleNamespace(role=role, batch_invariant=inv) for name, role, inv in
            [("prefill", "prefill", False), ("decode", "decode", False), ("decode_invariant", "decode", True)]}
    assert exporter.trace_order(["prefill", "decode", "decode_invariant"], defs) == \
        ["decode_invariant", "decode", "prefill"]
    assert exporter.trace_order(["decode", "prefill"], defs) == ["decode", "prefill"]


def test_the_cuda_wrapper_compiles_at_o0_unless_the_user_says(monkeypatch):
    monkeypatch.delenv(exporter.WRAPPER_OPT_ENV, raising=False)
    key = "aot_inductor.compile_wrapper_opt_level"
    assert exporter._inductor_configs("g++", False, "cuda")[key] == "O0"
    assert key not in exporter._inductor_configs("g++", False, "cpu")  # CPU decode runs the wrapper every step
    monkeypatch.setenv(exporter.WRAPPER_OPT_ENV, "O1")  # the user's level, in every process that compiles
    assert exporter._inductor_configs("g++", False, "cuda")[key] == "O1"
    assert exporter._inductor_configs("g++", False, "cpu")[key] == "O1"


def test_exports_compile_without_line_tables(monkeypatch):
    """Every g++ call of an export (the wrapper at its level, the CPU kernels at -O3) goes without -g1: the flags
    Inductor builds under the export's configs."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpp_builder import _get_optimization_cflags

    monkeypatch.delenv(exporter.WRAPPER_OPT_ENV, raising=False)
    assert "g1" in _get_optimization_cflags("g++", min_optimize=True)[0]  # torch's default: line tables on
    for device in ("cpu", "cuda"):
        with inductor_config.patch(exporter._inductor_configs("g++", False, device)):
            for min_optimize in (True, False):
                cflags = _get_optimization_cflags("g++", min_optimize=min_optimize)[0]
                assert "g1" not in cflags and not any(f.startswith("g") and f[1:].isdigit() for f in cflags), cflags


def test_compile_jobs(monkeypatch):
    monkeypatch.delenv(compile_worker.JOBS_ENV, raising=False)
    assert compile_jobs(8, 3) == 3 and compile_jobs(1, 3) == 1
    monkeypatch.setenv(compile_worker.JOBS_ENV, "1")
    assert compile_jobs(None, 3) == 1
    monkeypatch.setenv(compile_worker.JOBS_ENV, "many")
    with pytest.raises(onecopy.ExportError, match="ONECOPY_EXPORT_JOBS='many'"):
        compile_jobs(None, 3)
    with pytest.raises(onecopy.ExportError, match=r"jobs=0 must be a positive number of compile workers \(--jobs\)"):
        onecopy.export("tiny-llama", "/tmp/never", jobs=0)


def test_a_method_failing_in_a_worker_is_an_export_error_naming_it(tiny_source, tmp_path, monkeypatch):
    real = exporter.make_task

    def broken_decode(name, ep, package, configs, *rest):
        if name == "decode":
            configs = {**configs, "aot_inductor.output_path": "refused.pt2"}  # aoti_compile_and_package refuses it
        return real(name, ep, package, configs, *rest)

    monkeypatch.setattr(exporter, "make_task", broken_decode)
    with CompileWorkers(2) as pool:  # a caller's pool: a failure stops its workers (the next export starts them)
        with pytest.raises(onecopy.ExportError, match=r"compiling method 'decode' failed: RuntimeError: Please pass "
                                                      r"in a package path") as e:
            onecopy.export(tiny_source, tmp_path / "b", max_seq_len=TINY_MAX_SEQ_LEN, progress=False, workers=pool)
        assert pool.workers == [] and pool.idle == [] and not pool.busy
    assert "Traceback" in str(e.value.__cause__)  # the worker's
    assert list(tmp_path.iterdir()) == []  # no bundle, no partial directory


def test_a_callers_pool_of_workers_outlives_the_export_and_makes_the_same_bundle(tiny_source, tmp_path, serial_bundle):
    with CompileWorkers(2) as pool:
        pids = [w.proc.pid for w in pool.workers]
        out = onecopy.export(tiny_source, tmp_path / "b", max_seq_len=TINY_MAX_SEQ_LEN, progress=False, workers=pool)
        # the same processes, alive and idle for the caller's next export
        assert [w.proc.pid for w in pool.workers] == pids and all(w.proc.poll() is None for w in pool.workers)
        assert len(pool.idle) == 2 and not pool.busy and pool.serves_this_process()
        procs = [w.proc for w in pool.workers]
    assert all(p.poll() is not None for p in procs)  # the caller's close stopped them
    assert _manifest(out) == _manifest(serial_bundle)
