"""Shared fixtures. Every bundle comes from the test bundle cache (`bundle_cache.cached_bundle`): exported once,
reused by every module and by later runs while nothing that shapes it changes."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import onecopy
from onecopy.export.compile_worker import CompileWorkers, compile_jobs
from onecopy.models.source import EMBEDDED_DEFAULT, EMBEDDED_WHISPER, ModelSource, preset_source, resolve_source

from . import bundle_cache
from .bundle_cache import cached_bundle

# The tests' bundles compile their C++ wrapper at -O0 (2 of a 2-layer method's ~6 s on CI's 2 cores; the level
# moves only a CPU step's host-side overhead, which no test times), unless the environment says otherwise.
os.environ.setdefault("AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL", "O0")
TINY_MAX_SEQ_LEN = 64
# Seconds an export that the cache misses may take (smollm2's takes ~2.5 min on 2 idle cores), on top of
# the test's own timeout (pyproject.toml: timeout): the test's timer stops while it runs.
EXPORT_TIMEOUT_S = 900


@pytest.fixture(scope="session")
def tiny_source() -> ModelSource:
    return preset_source("tiny-llama")


@pytest.fixture(scope="session", autouse=True)
def compile_pool():
    """One pool of compile workers for the session's exports through the bundle cache, kept between them: each
    fresh worker costs ~7 s of CPU to import torch and Inductor, and more to warm up (the bundles are the same)."""
    n = compile_jobs(None, 2)
    if n < 2:
        yield None
        return
    with CompileWorkers(n, start=False) as pool:  # started at the first export that misses the cache
        bundle_cache.export_workers = pool
        try:
            yield pool
        finally:
            bundle_cache.export_workers = None


@pytest.fixture(scope="session")
def tiny_bundle() -> Path:
    return cached_bundle("tiny-llama", max_seq_len=TINY_MAX_SEQ_LEN)


@pytest.fixture(scope="session")
def tiny_rows_bundle() -> Path:
    """The KV cache as one row of max_seq_len positions per session (no paged KV, no prefix cache)."""
    return cached_bundle("tiny-llama", max_seq_len=TINY_MAX_SEQ_LEN, kv_block=None)


@pytest.fixture(scope="session")
def fallback_bundle() -> Path:
    """prefill weightless, decode compiled the default way (carries its own weights)."""
    return cached_bundle("tiny-llama", max_seq_len=TINY_MAX_SEQ_LEN, embed_weights=("decode",))


@dataclass
class CliExport:
    """A real `onecopy export` by the command line (not through the bundle cache)."""

    checkpoint: Path  # tiny-llama saved as an HF checkpoint directory: the source
    out: Path  # the bundle the command wrote
    result: "CliResult"


@pytest.fixture(scope="session")
def decode_only_export(tmp_path_factory: pytest.TempPathFactory, tiny_source: ModelSource) -> CliExport:
    """`onecopy export CHECKPOINT --max-seq-len 32 --methods decode`: tiny-llama's weights from an HF checkpoint
    directory, decode only (the cheapest bundle that generates). One real export for the session: test_cli checks
    the command and its bundle, test_scheduler serves the bundle (prompts through the batched decode)."""
    root = tmp_path_factory.mktemp("decode_only")
    checkpoint = root / "ckpt"
    tiny_source.save_hf(checkpoint)
    out = root / "b"
    return CliExport(checkpoint, out, run_cli("export", checkpoint, "--out", out, "--max-seq-len", "32", "--methods", "decode"))


@pytest.fixture
def tiny_engine(tiny_bundle: Path):
    with onecopy.Engine.load(tiny_bundle) as engine:
        yield engine


@pytest.fixture
def det_engine(tiny_bundle: Path):
    """Deterministic mode: every decode step at the full pool size, each session at its own row."""
    with onecopy.Engine.load(tiny_bundle, max_sessions=6, deterministic=True) as engine:
        yield engine


@pytest.fixture(scope="session")
def smollm2_source() -> ModelSource:
    return resolve_source("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_bundle() -> Path:
    return cached_bundle(EMBEDDED_DEFAULT, max_seq_len=256)


@pytest.fixture(scope="module")
def smol_engine(smollm2_bundle: Path):
    with onecopy.Engine.load(smollm2_bundle, max_sessions=4) as engine:
        yield engine


@pytest.fixture
def smol_server(smol_engine):
    """`onecopy serve` of SmolLM2 on loopback (its engine as ``.engine``); every conversation closed after."""
    from onecopy.serve import BackgroundServer, ServerConfig

    with BackgroundServer(smol_engine, ServerConfig(model_name="smollm2")) as server:
        server.engine = smol_engine
        yield server
    assert wait_until(lambda: smol_engine.sessions_open == 0)  # the cache closed every conversation


def copy_bundle(src: Path, dst: Path) -> Path:
    """A writable copy of a bundle, to damage or change (cached bundles are read-only: never write into one)."""
    shutil.copytree(src, dst, copy_function=shutil.copyfile)  # contents only: the copy's files are writable
    return dst


def export_through_cache(source, out_dir, *, overwrite: bool = False, progress: bool = True, **options) -> Path:
    """`onecopy.export` for tests that export as a user would (the CLI, the API) without the cost: the same
    export options give the cached bundle, copied to ``out_dir``. The refusals of `onecopy.export` stay its own:
    an existing ``out_dir`` without ``overwrite``, and every bad option (nothing is cached for those, so the
    real exporter runs and raises)."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        return bundle_cache._EXPORT(source, out, overwrite=False, progress=False, **options)  # its refusal
    bundle = cached_bundle(source, **options)
    if out.exists():
        shutil.rmtree(out)
    return copy_bundle(bundle, out)


@pytest.fixture
def exports_via_cache(monkeypatch: pytest.MonkeyPatch):
    """`onecopy.export` (as tests and the CLI's `export` call it) goes through `export_through_cache`."""
    from onecopy.export import exporter

    monkeypatch.setattr(onecopy, "export", export_through_cache)
    monkeypatch.setattr(exporter, "export", export_through_cache)  # what `onecopy export` calls


@dataclass
class CliResult:
    """What `run_cli` saw, as subprocess.run would report it."""

    returncode: int
    stdout: str
    stderr: str
    stdout_writes: list[str]  # each write to stdout, in order (a streamed reply arrives in several)


class _Recording(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def run_cli(*args: str) -> CliResult:
    """`onecopy ARGS` in this process: `onecopy.cli.main` with stdout and stderr captured, its exit status
    (argparse's usage errors included) and the logging set-up it does undone afterwards."""
    from onecopy.cli import main

    out, err = _Recording(), io.StringIO()
    root, log = logging.getLogger(), logging.getLogger("onecopy")
    handlers, level = root.handlers[:], log.level
    root.handlers = []  # main's logging.basicConfig installs its handler (on the captured stderr) only on a bare root
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse: usage errors exit 2, --help 0
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        root.handlers = handlers
        log.setLevel(level)
    return CliResult(code, out.getvalue(), err.getvalue(), out.writes)


def eager_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from an eager onecopy Transformer (prefill, then one token at a time)."""
    out = []
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids)))
        pos = len(ids)
        for _ in range(n):
            t = int(logits.argmax(-1))
            out.append(t)
            logits = model(torch.tensor([[t]]), torch.tensor([pos]))
            pos += 1
    return out


def hf_greedy(source: ModelSource, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from transformers' LlamaForCausalLM on the same weights (full recompute each step)."""
    import transformers

    from onecopy.models.hf_checkpoint import hf_config_from_llama

    cfg = transformers.LlamaConfig(**hf_config_from_llama(source.config))
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(source.hf_state_dict, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.fixture(scope="session")
def whisper_source():
    return resolve_source("whisper-tiny.en")


@pytest.fixture(scope="session")
def whisper_bundle() -> Path:
    return cached_bundle(EMBEDDED_WHISPER)


SPOKEN = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="session")
def speech_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A WAV of SPOKEN made by espeak-ng (22.05 kHz: the transcriber resamples it)."""
    import subprocess

    if shutil.which("espeak-ng") is None:
        if os.environ.get("CI") or os.environ.get("ONECOPY_REQUIRE_ESPEAK"):
            pytest.fail("espeak-ng is required here (apt-get install espeak-ng)")
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")
    out = tmp_path_factory.mktemp("audio") / "fox.wav"
    subprocess.run(["espeak-ng", "-w", str(out), SPOKEN], check=True)
    return out


class HostReads:
    """Counts every way a tensor's values are read into Python/host memory while active."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__index__", "__bool__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[tuple[str, int, torch.dtype, int]] = []
        for name in self.METHODS:
            real = getattr(torch.Tensor, name)

            def spy(t, *a, _real=real, _name=name, **k):
                self.reads.append((_name, t.numel(), t.dtype, t.data_ptr()))
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, spy)


def wait_until(pred, timeout: float = 10.0) -> bool:
    """Poll ``pred`` until true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@dataclass
class PreemptedRuns:
    ids: list  # each request's generated ids
    states: list  # each request's row state at its end (kept sessions)
    preemptions: int
    references: int  # KV block references left once every session closed (0: none leaked)
    eos_ids: list


# Six requests whose prompts and outputs need 4 KV blocks each, on 10 blocks: rows grow into each other's and the
# newest are preempted and resumed, again and again (tests/test_preemption.py, test_structured_outputs.py)
PREEMPTING_PROMPTS = [[3 + (7 * i + j) % 200 for j in range(20 + i)] for i in range(6)]


def run_preempting(bundle: Path, params: list, *, deterministic: bool, overlap: bool | None = None) -> PreemptedRuns:
    """`PREEMPTING_PROMPTS` with ``params`` on an engine of 10 KV blocks, all queued before the first step (the same
    preemptions on every machine), each kept session read and closed on its own thread (its blocks free others')."""
    load = dict(max_sessions=6, kv_blocks=10, deterministic=deterministic, new_token_ratio=0.0)
    with onecopy.Engine.load(bundle, **load) as engine:
        if overlap is not None:
            engine.loop.overlap = overlap
        with engine.lock:
            streams = [engine.submit(p, q, chat=False, stop_ids=[], keep_session=True)
                       for p, q in zip(PREEMPTING_PROMPTS, params)]
        got, states = [None] * 6, [None] * 6

        def collect(i: int) -> None:
            got[i] = list(streams[i].result())
            states[i] = {k: v.clone() for k, v in streams[i].session.state.items()}
            streams[i].session.close()

        threads = [threading.Thread(target=collect, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return PreemptedRuns(got, states, engine.scheduler.stats.preemptions, engine.scheduler.kv.usage()["references"],
                             engine.eos_token_ids)


# -------------------------------------------------------------------------------- timeouts and the bundle cache

_current_item: pytest.Item | None = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    global _current_item
    _current_item = item
    try:
        yield
    finally:
        _current_item = None


@contextlib.contextmanager
def _export_timeout():
    """An export the cache misses runs under a timer of its own (EXPORT_TIMEOUT_S), not the test's: the test's
    timer (pytest-timeout) stops for it and starts afresh after it."""
    item = _current_item
    try:
        from pytest_timeout import Settings, _get_item_settings

        settings = _get_item_settings(item) if item is not None else None
    except Exception:  # pytest-timeout absent or changed: the test's own timer goes on
        settings = None
    if settings is None or not settings.timeout or settings.func_only:
        yield
        return
    hook = item.config.hook
    hook.pytest_timeout_cancel_timer(item=item)
    hook.pytest_timeout_set_timer(item=item, settings=Settings(EXPORT_TIMEOUT_S, *settings[1:]))
    try:
        yield
    finally:
        hook.pytest_timeout_cancel_timer(item=item)
        hook.pytest_timeout_set_timer(item=item, settings=settings)


bundle_cache.export_guard = _export_timeout


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    damaged = bundle_cache.check_entries_used()
    session.config.stash[_DAMAGED] = damaged
    if damaged:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    bundle_cache.prune()


_DAMAGED = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    exported, used = bundle_cache.exports_run(), bundle_cache.entries_used()
    if not used:
        return
    where = bundle_cache.cache_root() or "a temporary directory (ONECOPY_TEST_CACHE=off)"
    line = (f"bundle cache {where}: {len(used)} bundles used, {len(exported)} exported this run"
            + (f" ({', '.join(f'{n} {s:.0f}s' for n, s in exported)})" if exported else ""))
    terminalreporter.write_line(line)
    for name in config.stash.get(_DAMAGED, []):
        terminalreporter.write_line(f"ERROR: a test wrote into the cached bundle {name} (removed; damage a "
                                    "conftest.copy_bundle copy instead)", red=True)
