"""Where `onecopy.export` spends its time: one full export, timed per phase and per method.

Usage (from the repository root; each run is one fresh process, as `onecopy export` is):
    python benchmarks/export_time.py --source smollm2-135m-instruct --max-seq-len 256 \\
        --out benchmarks/results/export_time_smollm2_cpu.json
    # the GPU presets (3 methods: prefill, decode, decode_invariant):
    python benchmarks/export_time.py --source llama3-8b-8l --device cuda --out benchmarks/results/export_time_h100.json
    python benchmarks/export_time.py --source llama3-8b --device cuda --out benchmarks/results/export_time_h100.json
    # the same, the methods compiled one after another in the exporting process (--jobs 1):
    python benchmarks/export_time.py --source llama3-8b --device cuda --jobs 1 --out ...
    # before: the onecopy of another checkout, e.g. the commit this work started from, same script:
    git worktree add --detach /tmp/oc-main 70e8b58   # (or: mkdir /tmp/oc-main && git archive 70e8b58 | tar -x -C /tmp/oc-main)
    python benchmarks/export_time.py --source llama3-8b --device cuda --onecopy /tmp/oc-main --label before --out ...

Each run is appended to --out's "runs" (the file is created if missing), so before/after land side by side.
Options after the known ones are passed to `onecopy.export` as keyword arguments (``--kv-dtype int8``,
``--quantize fp8``, ``--kv-block 16``, ...). ``--inductor KEY=VALUE`` sets a torch._inductor.config entry
for the run (e.g. ``aot_inductor.compile_wrapper_opt_level=O0``); the compile workers inherit it.

Caches: by default every run gets fresh, empty Inductor and Triton cache directories (the first export on a
machine: every kernel compiled); ``--cache shared`` keeps the user's (a re-export: kernels already built
are reused).

Recorded per run: the phases (read and build the model, trace each method, the decomposition the old
exporter ran only to read the mutated state, compile each method, the package reload the old exporter ran
only to read its constants, write weights and manifest), each method's compile seconds with Inductor's own
timers (`torch._dynamo.utils.compilation_time_metrics`: AOT autograd's trace, lowering, scheduling and
kernel codegen, C++/Triton compiles), the total, the CPU seconds of every process the export ran, and the
machine (device, CPUs, load average: on a shared machine, wall time is only comparable at equal load). A onecopy
that takes ``export(timings=...)`` reports its phases itself (compiles in worker processes included);
for an older one the script times the same calls by wrapping them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Inductor timers worth a column (the rest stay in "inductor"): what they cover in torch 2.11-2.13.
HEADLINE = {
    "aot_trace": "create_aot_dispatcher_function",  # AOT autograd: functionalize + decompose (a full trace)
    "lowering": "GraphLowering.run",  # FX graph -> Inductor IR
    "scheduling": "Scheduler.__init__",  # fusion decisions
    "codegen": "GraphLowering.codegen",  # scheduling + kernel codegen (+ async kernel compiles waited on)
    "wrapper_and_kernel_cxx": "AotCodeCompiler.compile",  # the C++ wrapper (+ CPU kernels) compile and link
    "compile_file": "compile_file",  # every C++ compiler call
    "triton_wait": "async_compile.wait",  # waiting for Triton kernel compiles (CUDA)
}


def _passthrough(extra: list[str]) -> dict:
    """--kv-dtype int8 --no-native-kernels ... -> export() keyword arguments."""
    kwargs, i = {}, 0
    while i < len(extra):
        key = extra[i]
        if not key.startswith("--"):
            raise SystemExit(f"unexpected argument {key!r}")
        name = key[2:].replace("-", "_")
        if name.startswith("no_") and (i + 1 == len(extra) or extra[i + 1].startswith("--")):
            kwargs[name[3:]] = False
            i += 1
            continue
        if i + 1 == len(extra) or extra[i + 1].startswith("--"):
            kwargs[name] = True
            i += 1
            continue
        value = extra[i + 1]
        if value.lower() == "none":
            kwargs[name] = None
        else:
            try:
                kwargs[name] = int(value)
            except ValueError:
                kwargs[name] = value
        i += 2
    return kwargs


def _child(a: argparse.Namespace, kwargs: dict) -> dict:
    """One export in this (fresh) process; returns the run's record."""
    sys.path.insert(0, str(Path(a.onecopy).resolve()))
    import importlib
    import inspect

    import torch
    import torch._inductor
    from torch._dynamo.utils import compilation_time_metrics

    for item in a.inductor:
        key, _, value = item.partition("=")
        target = torch._inductor.config
        *path, last = key.split(".")
        for p in path:
            target = getattr(target, p)
        old = getattr(target, last)
        setattr(target, last, type(old)(value) if isinstance(old, (int, float)) and not isinstance(old, bool)
                else (value.lower() in ("1", "true")) if isinstance(old, bool) else value)

    exporter = importlib.import_module("onecopy.export.exporter")
    wrapped: dict[str, list[float]] = {}

    def wrap(obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                wrapped.setdefault(key, []).append(round(time.perf_counter() - t, 3))
        setattr(obj, name, timed)

    wrap(exporter, "resolve_source", "read source")
    wrap(torch.export, "export", "trace")
    wrap(torch.export.ExportedProgram, "run_decompositions", "decompose")
    wrap(torch._inductor, "aoti_compile_and_package", "compile (in the exporting process)")
    wrap(torch._inductor, "aoti_load_package", "reload package")
    wrap(exporter, "_write_bundle", "write bundle")

    params = inspect.signature(exporter.export).parameters
    timings: dict = {}
    if "timings" in params:
        kwargs["timings"] = timings
    if a.jobs is not None:
        if "jobs" not in params:
            raise SystemExit("this onecopy compiles its methods one after another: drop --jobs")
        kwargs["jobs"] = a.jobs
    out = Path(a.work) / "bundle"
    start = time.perf_counter()
    exporter.export(a.source, out, max_seq_len=a.max_seq_len, device=a.device, overwrite=True, progress=not a.quiet,
                    **kwargs)
    total = time.perf_counter() - start
    methods = json.loads((out / "manifest.json").read_text())["methods"]
    record = {
        "device_name": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "total_s": round(total, 1),
        "calls_s": wrapped,  # wrapped calls made in the exporting process, in order
        "phases_s": timings.get("phases"),  # the exporter's own phases (None: this onecopy does not report them)
        "methods": list(methods),
        "package_mb": {m: round((out / spec["package"]).stat().st_size / 2 ** 20, 1) for m, spec in methods.items()},
    }
    detail = (timings.get("detail") or {}).get("compile")
    if detail:  # per method, wherever it compiled
        record["compile_s"] = {m: {"total": d["seconds"], "where": d.get("where"), "received_in_worker": d.get("received", 0.0),
                                   **{k: round(d["inductor"].get(v, 0.0), 1)
                                                              for k, v in HEADLINE.items()}, "inductor": d["inductor"]}
                               for m, d in detail.items()}
    else:  # an older exporter: the in-process compiles in order, and Inductor's timers over all of them
        record["compile_s"] = dict(zip(methods, wrapped.get("compile (in the exporting process)", [])))
        record["inductor_all_methods_s"] = {k: round(sum(v), 3) for k, v in compilation_time_metrics.items()}
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", required=True, help="preset, .gguf or checkpoint dir (as `onecopy export`)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--max-seq-len", type=int)
    ap.add_argument("--out", required=True, help="JSON to append this run to")
    ap.add_argument("--jobs", type=int, help="compile workers (export(jobs=...)); 1: one method after another here")
    ap.add_argument("--onecopy", default=str(ROOT), help="the checkout whose onecopy to time (default: this one)")
    ap.add_argument("--cache", choices=["fresh", "shared"], default="fresh",
                    help="fresh: empty Inductor/Triton caches for the run (default); shared: the user's")
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="a torch._inductor.config entry for the run (repeatable)")
    ap.add_argument("--work", help="where the bundle (and fresh caches) go (default: a temporary directory)")
    ap.add_argument("--label", default="", help="a note stored with the run (e.g. 'before', 'after')")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a, extra = ap.parse_known_args()
    kwargs = _passthrough(extra)
    if a.child:
        # Each phase on stderr as it ends: a run cut off by a timeout still shows where its time went.
        logging.basicConfig(format="%(asctime)s %(message)s", stream=sys.stderr)
        logging.getLogger("onecopy.export").setLevel(logging.INFO)
        print("RESULT " + json.dumps(_child(a, kwargs)), flush=True)
        return

    work = Path(a.work or tempfile.mkdtemp(prefix="onecopy-export-time-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if a.cache == "fresh":
        caches = Path(tempfile.mkdtemp(prefix="caches-", dir=work))
        env["TORCHINDUCTOR_CACHE_DIR"] = str(caches / "inductor")
        env["TRITON_CACHE_DIR"] = str(caches / "triton")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--work", str(work), *sys.argv[1:]]
    load_before = os.getloadavg()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the export failed (exit code {proc.returncode})")
    record = json.loads(lines[-1][len("RESULT "):])

    commit = subprocess.run(["git", "-C", a.onecopy, "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    run = {"label": a.label, "command": "python " + " ".join(sys.argv), "onecopy": a.onecopy,
           "onecopy_commit": commit.stdout.strip()[:100], "source": a.source, "device": a.device,
           "cpus": len(os.sched_getaffinity(0)), "cache": a.cache, "jobs": a.jobs, "inductor": a.inductor,
           "export_kwargs": kwargs,
           "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
           # CPU seconds of the export and every process it started and waited for (workers, compilers)
           "cpu_s": round(after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime, 1),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **record}
    out = Path(a.out)
    doc = json.loads(out.read_text()) if out.exists() else {"what": __doc__.split("\n")[0], "runs": []}
    doc["runs"].append(run)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    summary = {k: run[k] for k in ("label", "total_s", "cpu_s", "phases_s", "calls_s")}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
