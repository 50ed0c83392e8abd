"""The Engine: one bundle loaded on one device, its weights held once, a state pool for its sessions.

A facade that loads and wires parts with one job each, in one direction:
- `weights.WeightStore` and `method.Method`: each weight once on the device, every method bound to it;
- `scheduler.Scheduler` (host only): requests, admission, chunking, stop rules, the rows and the
  `kv_manager.KVCacheManager`; its plans carry the state operations its decisions imply;
- `runner.ModelRunner` (device): the pool and KV blocks, the decode step and graphs, the sampler;
- `loop.EngineLoop`: the thread that plans, runs and streams;
- `sessions.Sessions`: open sessions and what they run by themselves (fail closed).
The engine sizes the pool (`memory`), checks and submits requests, and reports memory.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from ..bundle import TOKENIZER, Manifest, read_bundle
from ..errors import EngineClosedError, InputError, SessionCapacityError
from ..grammar import GrammarCompiler
from ..params import SamplingParams
from ..tokenizer import Tokenizer
from .config import EngineConfig
from .cpu_threads import on_short_lived_thread
from .kv_manager import KVSpec
from .kv_tiers import TierIndex
from .kv_warm import HostTierWarmer
from .loop import EngineLoop
from .memory import (MemoryReport, default_reserve, device_used, engine_report, row_bytes, size_blocks, size_paged_sessions,
                     size_pool)
from .method import Method
from .prompts import Prompts
from .request import Request
from .runner import ModelRunner
from .scheduler import Scheduler
from .session import Session
from .sessions import Sessions
from .state import SessionSnapshot
from .stream import TokenStream
from .tier_store import TierStore
from .turn_lock import TurnLock
from .weights import WeightStore

log = logging.getLogger(__name__)

DEFAULT_PREFILL_CHUNK = 512


def methods_to_load(manifest: Manifest, deterministic: bool) -> list[str]:
    """The methods an engine loads: every method but one decode. Deterministic: the batch-invariant one
    if the bundle has it (CUDA bundles), else the plain one, run one row per call (`runtime.step`).
    Default: the fastest (the one that is not batch-invariant)."""
    decodes = [n for n, m in manifest.methods.items() if m.role == "decode"]
    invariant = [n for n in decodes if manifest.methods[n].batch_invariant]
    plain = [n for n in decodes if n not in invariant]
    keep = (invariant or plain)[:1] if deterministic else (plain or invariant)[:1]
    return [n for n in manifest.methods if n not in decodes or n in keep]


class Engine:
    """Owns the weight store, the model runner, the scheduler, its loop and the sessions. Create with `Engine.load`."""

    def __init__(self, path: Path, manifest: Manifest, device: torch.device, methods: dict[str, Method],
                 store: WeightStore, baseline_used: int) -> None:
        self.path, self.manifest, self.device = path, manifest, device
        self._methods, self._store = methods, store
        self._baseline_used = baseline_used
        self._lock = TurnLock()  # the loop lets a waiting caller (a session's direct call) in between steps
        self.prompts = Prompts(manifest, path)
        self.closed = False
        self.config = EngineConfig()
        self.runner: ModelRunner | None = None
        self.scheduler: Scheduler
        self.loop: EngineLoop
        self.sessions: Sessions
        self.pool_sizing = ""
        self.prefix_cache = False  # shared prompt blocks (`runtime.prefix`); see prefix_cache_note
        self.prefix_cache_note = ""
        self.single_session_reason: str | None = None  # the bundle writes constants in place: one session at a time
        self._initial_constants: dict[str, torch.Tensor] = {}  # those constants as exported

    @classmethod
    def load(cls, bundle_dir: str | Path, device: str | torch.device = "cpu", config: EngineConfig | None = None,
             **options: object) -> "Engine":
        """Validate the whole bundle, load each method and each needed weight once, allocate the state pool.

        ``config`` (an `EngineConfig`) and ``options`` (its fields by name, e.g. ``max_sessions=8,
        deterministic=True``, replacing the config's) say how it runs; see `EngineConfig`.
        Raises a BundleError subclass, InputError or SessionCapacityError, and then holds nothing.
        """
        config = EngineConfig.of(config, **options)
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise InputError("device='cuda' asked for but no CUDA GPU is visible; load with device='cpu'")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.init()
        if config.cuda_graphs and dev.type != "cuda":
            raise InputError("cuda_graphs=True needs a CUDA device; load with device='cuda' or cuda_graphs=False")
        # On a CPU, on a thread that exits: no OpenMP team of the caller's thread beside the loop's (cpu_threads).
        load = functools.partial(cls._load, Path(bundle_dir), dev, config)
        engine = on_short_lived_thread(load) if dev.type == "cpu" else load()
        if engine.single_session_reason:
            warnings.warn(f"bundle {bundle_dir}: {engine.single_session_reason}", stacklevel=2)
        if any(m.embeds_weights for m in engine._methods.values()):
            warnings.warn(f"bundle {bundle_dir} has methods that carry their own weights "
                          f"({engine.memory_report().duplicated_weight_bytes} duplicated bytes); "
                          "export it again with onecopy to share one copy", stacklevel=2)
        return engine

    @classmethod
    def _load(cls, bundle_dir: Path, dev: torch.device, config: EngineConfig) -> "Engine":
        """`load`'s work, on its device (``config`` checked)."""
        baseline = device_used(dev)
        bundle = read_bundle(Path(bundle_dir), dev.type)
        manifest = bundle.manifest
        methods: dict[str, Method] = {}
        store = WeightStore(dev)
        engine = None
        try:
            for name in methods_to_load(manifest, config.deterministic):
                methods[name] = Method(manifest.methods[name], bundle.package_path(name), dev)
            store.load(bundle, {f for m in methods.values() if not m.embeds_weights for f in m.weight_fqns})
            for m in methods.values():
                m.bind_weights(store)
            engine = cls(Path(bundle_dir), manifest, dev, methods, store, baseline)
            mutated = sorted({c for m in methods.values() for c in m.spec.mutated_constants})
            if mutated:
                engine.single_session_reason = (
                    f"methods write the constants {mutated[:3]} in place, so sessions would share them: capacity is 1. "
                    "Re-export the bundle with onecopy to serve several sessions")
                engine._initial_constants = {f: bundle.weights[f].clone() for f in mutated if f in bundle.weights}
                config = EngineConfig.of(config, max_sessions=1, deterministic=False)
            engine._setup(config)
        except BaseException:
            if engine is not None:
                engine.close()
            else:
                for m in methods.values():
                    m.close()
                store.clear()
            raise
        finally:
            bundle.close()
        return engine

    def _setup(self, config: EngineConfig) -> None:
        """Size the pool, build the runner (pool, sampler, decode step, graphs), the scheduler, its loop
        and the sessions."""
        m, c = self.manifest, config
        self.config = c
        if not m.state:
            raise InputError(f"bundle {self.path} declares no session state; this onecopy serves stateful methods")
        decode = self._role("decode")
        if c.cuda_graphs and (decode is None or decode.embeds_weights):
            raise InputError(f"cuda_graphs=True needs a 'decode' method bound to the shared weights; bundle "
                             f"{self.path} has {', '.join(self._methods)}: load it with cuda_graphs=False")
        reserve = default_reserve(self.device) if c.reserve_bytes is None else c.reserve_bytes
        fixed, full = row_bytes(m)
        paged, blocks = bool(m.paged_state), 0
        if paged and c.max_sessions is not None:  # rows are cheap, blocks the capacity
            rows, blocks, self.pool_sizing = size_paged_sessions(
                c.max_sessions, m, fixed, self.device, kv_blocks=c.kv_blocks, memory_budget=c.memory_budget,
                memory_fraction=c.memory_fraction, reserve=reserve)
        else:
            rows, self.pool_sizing = size_pool(full, self.device, max_sessions=c.max_sessions,
                                               memory_budget=c.memory_budget, memory_fraction=c.memory_fraction,
                                               reserve=reserve)
            if paged:
                rows, blocks, self.pool_sizing = size_blocks(
                    rows, self.pool_sizing, m, fixed, self.device, kv_blocks=c.kv_blocks,
                    sized_by_user=c.memory_budget is not None, memory_fraction=c.memory_fraction, reserve=reserve)
        if not paged:
            self.prefix_cache_note = "prefix cache off: this bundle's state has a row per session (no paged KV)"
        elif not c.prefix_cache:
            self.prefix_cache_note = "prefix cache off (prefix_cache=False)"
        elif c.deterministic:
            self.prefix_cache_note = ("deterministic prefix cache: prompt blocks only, hits cut at a multiple of the "
                                      "prefill chunk (a turn gets the bits of its whole history prefilled)")
        self.prefix_cache = paged and c.prefix_cache
        self.runner = ModelRunner(self.path, m, self.device, self._methods, self._store, rows,
                                  deterministic=c.deterministic, cuda_graphs=c.cuda_graphs,
                                  decode_buckets=c.decode_buckets, kv_blocks=blocks)
        # grammars for constrained outputs, checked at submit (the tokenizer's llguidance form built at the first)
        self.grammars = GrammarCompiler(self.path / TOKENIZER, self.eos_token_ids, int(m.config["vocab_size"]))
        self.runner.sampler.grammars = self.grammars
        log.info("%s on %s: %s; decode %s%s", self.path.name, self.device, self.pool_sizing,
                 decode.name if decode else "none",
                 f", graphs for {self.runner.graph_buckets}" if self.runner.graph_buckets else "")
        prefill_chunk = min(c.prefill_chunk or DEFAULT_PREFILL_CHUNK, self.prefill_bound)
        kv = KVSpec(blocks, m.table_width, m.kv_block_size, self.prefix_cache,
                    aligned=prefill_chunk if c.deterministic else 0) if paged else None
        tiers = None
        if c.kv_host_bytes or c.kv_disk_dir:
            if self.prefix_cache:
                tiers = self._kv_tiers(c, prefill_chunk)
                if tiers is None:
                    self.prefix_cache_note = ("KV tiers off: kv_host_bytes holds no block and the disk tier has no "
                                              "room (kv_disk_dir without kv_disk_bytes)")
            else:
                self.prefix_cache_note += "; the KV tiers (kv_host_bytes, kv_disk_dir) keep its blocks: off too"
        self.scheduler = Scheduler(rows, max_seq_len=m.max_seq_len, has_prefill=self.has_prefill,
                                   prefill_chunk=prefill_chunk,
                                   max_queue=c.max_queue, max_batch=c.max_batch, token_budget=c.token_budget, kv=kv,
                                   tiers=tiers,
                                   replay_in_decode=c.deterministic, new_token_ratio=c.new_token_ratio)
        self._warmer = HostTierWarmer(tiers, self.runner.blocks.tiers, self._lock) if tiers is not None else None
        # Overlap step t+1 with step t's ids on CUDA; not with recurrent state: the step queued after a
        # stop id would advance it for good.
        self.loop = EngineLoop(self.scheduler, self.runner, self._lock, on_admitted=self._admitted,
                               on_finished=self._finished, overlap=self.device.type == "cuda" and not self.recurrent_state,
                               recurrent_state=bool(self.recurrent_state))
        per_session = self.runner.pool.row_bytes + (blocks and m.table_width * self.runner.blocks.block_bytes)
        self.sessions = Sessions(runner=self.runner, scheduler=self.scheduler, lock=self._lock, manifest=m,
                                 prompts=self.prompts, state_bytes_per_session=per_session, check_open=self.check_open,
                                 usable=lambda: not (self.closed or self.failed),
                                 fail=self.loop.fail, submit=self.submit, wake=self.loop.wake,
                                 capacity_error=self._capacity_error, on_open=self._fresh_constants)

    def _kv_tiers(self, c: EngineConfig, prefill_chunk: int) -> TierIndex | None:
        """The host and disk tiers of the prefix cache (`kv_tiers`): their bytes held by the runner's blocks, their
        index for the scheduler's KV manager, with the files a disk tier already holds for this model (the
        oldest past ``kv_disk_bytes`` deleted); None when neither tier has room for a block."""
        m, blocks = self.manifest, self.runner.blocks
        assert blocks is not None
        fingerprint = m.fingerprint()
        # A deterministic engine's blocks hold a prefill's bits for its chunk size and device: a directory of
        # their own.
        kind = f"-det{prefill_chunk}-{self.device.type}" if c.deterministic else ""
        directory = Path(c.kv_disk_dir) / f"kv-{fingerprint[:16]}{kind}" if c.kv_disk_dir else None
        slots = c.kv_host_bytes // blocks.block_bytes
        store = TierStore({k: m.state[k] for k in m.paged_state}, slots, directory, fingerprint, self.device)
        disk_blocks = c.kv_disk_bytes // store.file_bytes if directory is not None else 0
        if not slots and not disk_blocks:
            store.close()
            return None
        on_disk = store.keys_on_disk()
        over = max(0, len(on_disk) - disk_blocks)
        for key in on_disk[:over]:
            store.drop(key)
        blocks.tiers = store
        log.info("KV tiers: %d host slots (%.1f MiB)%s", slots, store.host_bytes / 2**20,
                 f", {disk_blocks} blocks on disk at {directory} ({len(on_disk) - over} there)" if directory else "")
        return TierIndex(slots, disk_blocks, on_disk[over:], read=store.read, probe=store.has_file)

    def _persist_kv(self) -> None:
        """At close, a disk tier takes every cached block the host and the device hold (`KVCacheManager.persist`):
        an engine started on the same directory finds them. Not after a device failure (its bytes are unknown)."""
        kv = self.scheduler.kv
        if kv is None or kv.tiers is None or not kv.tiers.disk_blocks or self.loop.failed:
            return
        kv.persist()
        try:
            self.runner.apply(self.scheduler.ops.take())
        except Exception:  # a full disk: what was written stays, the engine still closes
            log.exception("saving the KV cache to %s at close", self.config.kv_disk_dir)

    # -- introspection -------------------------------------------------------------------------
    @property
    def methods(self) -> list[str]:
        """Names of the loaded methods."""
        return list(self._methods)

    def method(self, name: str) -> Method:
        if name not in self._methods:
            raise InputError(f"bundle has no method {name!r}; it has {', '.join(self._methods)}")
        return self._methods[name]

    def _role(self, role: str) -> Method | None:
        return next((m for m in self._methods.values() if m.role == role), None)

    @property
    def lock(self) -> TurnLock:
        """Held while the device runs anything for this engine (a step, a session's direct call)."""
        return self._lock

    def role_method(self, role: str) -> str:
        """Name of the method with ``role`` (decode, prefill, encode); InputError if there is none."""
        m = self._role(role)
        if m is None:
            raise InputError(f"bundle {self.path} has no {role} method (it has {', '.join(self._methods)})")
        return m.name

    @property
    def has_prefill(self) -> bool:
        return self._role("prefill") is not None

    @property
    def max_seq_len(self) -> int:
        return self.manifest.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.prompts.vocab_size

    @property
    def prefill_bound(self) -> int:
        """Longest chunk one prefill call takes (1 when the bundle has no prefill: decode token by token)."""
        m = self._role("prefill")
        if m is None:
            return 1
        dim = m.spec.inputs[0].shape[1]
        return dim["max"] if isinstance(dim, dict) else dim

    @property
    def recurrent_state(self) -> list[str]:
        """State tensors not addressed by position (e.g. DeltaNet conv and recurrent state)."""
        return [f for f, spec in self.manifest.state.items() if spec.recurrent]

    @property
    def deterministic(self) -> bool:
        return self.config.deterministic

    @property
    def max_sessions(self) -> int:
        """Rows of the state pool: the most sessions open at once."""
        return self.scheduler.rows.rows

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.manifest.generation.get("eos_token_ids") or [])

    @property
    def tokenizer(self) -> Tokenizer:
        return self.prompts.tokenizer

    @property
    def weights(self) -> WeightStore:
        return self._store

    @property
    def state_bytes_per_session(self) -> int:
        """Bytes of state one session holds at most: its pool row, and with paged KV its blocks at max_seq_len."""
        return self.sessions.state_bytes_per_session

    @property
    def graph_buckets(self) -> list[int]:
        """Batch sizes with a captured decode graph (empty without graphs)."""
        return self.runner.graph_buckets if self.runner is not None else []

    @property
    def cuda_graphs(self) -> bool:
        return bool(self.graph_buckets)

    @property
    def failed(self) -> str | None:
        """Why the engine serves no more (a device call failed; the log has the cause), or None."""
        return self.loop.failed if hasattr(self, "loop") else None

    # -- input checks --------------------------------------------------------------------------
    def check_token_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as ints, each in [0, vocab_size); InputError naming the first bad one otherwise."""
        return self.prompts.check_token_ids(ids)

    def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = True) -> list[int]:
        """Token ids of a text prompt (through the chat template unless ``chat=False``) or of given ids."""
        return self.prompts.encode(prompt, chat=chat)

    def check_open(self) -> None:
        """EngineClosedError after close, EngineFailedError after a device call failed."""
        if self.closed:
            raise EngineClosedError("this Engine is closed; load the bundle again with Engine.load")
        if self.failed:
            raise self.loop.failure()

    # -- sessions ------------------------------------------------------------------------------
    @property
    def free_rows(self) -> int:
        """The pool's free rows (no checks: what a monitor reads, also after a failure)."""
        return self.scheduler.rows.free_rows if self.runner is not None and not self.closed else 0

    def capacity(self) -> int:
        """How many more sessions can be opened now: the pool's free rows."""
        self.check_open()
        return self.free_rows

    @property
    def sessions_open(self) -> int:
        return len(self.sessions)

    def open_session(self, restore: SessionSnapshot | str | Path | None = None) -> Session:
        """Take a free row of the state pool (zeroed) for a new session; SessionCapacityError when none is free.

        ``restore`` (a snapshot or a file written by `Session.save`) continues that conversation.
        """
        snap = SessionSnapshot.load(restore) if isinstance(restore, (str, Path)) else restore
        return self.sessions.open(snap)

    def release_session(self, session: Session) -> None:
        """Close ``session`` and give its row back (`Session.close` cancels its request first). Idempotent."""
        self.sessions.release(session)

    def _capacity_error(self) -> SessionCapacityError:
        extra = f" ({self.single_session_reason})" if self.single_session_reason else ""
        return SessionCapacityError(
            f"cannot open another session: all {self.max_sessions} rows of the state pool are in use "
            f"({self.pool_sizing}; {self.state_bytes_per_session} bytes each){extra}. Close a session, or load the "
            "engine with a larger max_sessions (export with a smaller --max-seq-len to fit more)")

    def _fresh_constants(self) -> None:
        """A bundle that writes constants in place: each session starts from them as exported."""
        for fqn, init in self._initial_constants.items():
            self._store.get(fqn).copy_(init)

    # -- requests ------------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, chat: bool = True,
               session: Session | None = None, stop_ids: Sequence[int] | None = None, keep_session: bool = False,
               encode_inputs: Sequence[torch.Tensor] | None = None) -> TokenStream:
        """Queue a generation request; returns its `TokenStream` at once (iterate or ``async for``).

        Text prompts go through the chat template unless ``chat=False``; token ids are taken as
        they are. ``session``: continue that session's state (it stays open afterwards); otherwise
        a row is taken when one is free (waiting in the queue until then) and released when the
        request ends, unless ``keep_session``: then the session (``stream.session``) stays open
        with the conversation and the caller closes it. ``stop_ids`` (default: the model's eos
        ids) end the request after being emitted; a request with a grammar also ends at an eos id (its grammar
        is complete). ``encode_inputs`` run through the encode method
        on the row before the prompt (e.g. audio features for a speech model). Raises InputError /
        PromptTooLongError for bad input, QueueFullError when ``max_queue`` requests already wait,
        EngineClosedError after close, EngineFailedError after a device error.
        """
        self.check_open()
        params = params or SamplingParams()
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # GrammarError (an InputError) with the engine's reason
        ids = self.prompts.encode(prompt, chat=chat)
        if encode_inputs is not None:
            encode_inputs = tuple(encode_inputs)
            self.method(self.role_method("encode")).check_inputs(encode_inputs)
        stop = frozenset(self.eos_token_ids if stop_ids is None else stop_ids)
        if params.grammar is not None:
            # A grammar allows an end-of-sequence id only once it is complete (and nothing else after): without it
            # among the stop ids (ignore_eos) the request would emit end-of-sequence ids until max_new_tokens.
            stop |= frozenset(self.eos_token_ids)
        req = Request(0, ids, params, stop, keep_row=keep_session, encode_inputs=encode_inputs)
        req.stream = stream = TokenStream(ids, params)
        if session is None:
            self.prompts.check_fits(ids, 0)
            return self._queue(req)
        if session.host is not self.sessions:
            raise InputError(f"session {session.id} belongs to another engine")
        session.attach(stream)  # no other request or call on it: its position is final until this one ends
        try:
            self.prompts.check_fits(ids, session.position)
            req.lease, req.owns_row, req.start = session.lease, False, session.position
            req.base = list(session.tokens[:session.position]) if session.tokens is not None else None
            stream.session = session
            return self._queue(req)
        except BaseException:
            session.detach(stream)
            raise

    def _queue(self, req: Request) -> TokenStream:
        if self.scheduler.kv is not None:
            self.scheduler.kv.check_request(req)
        return self.loop.submit(req)

    def _admitted(self, req: Request) -> None:
        """A request got its row (the loop, under the lock): a request on a row of its own gets a session."""
        if req.owns_row:
            self.sessions.adopt(req)
        req.stream.cached_tokens = req.cached

    def _finished(self, req: Request) -> None:
        """A request ended (the loop, under the lock): its session takes the outcome."""
        self.sessions.finished(req)

    # -- accounting ----------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Weights (unique, resident, duplicated), the state pool, graphs and device-level use of this Engine."""
        self.check_open()
        notes = [n for n in (self.single_session_reason, self.prefix_cache_note) if n]
        return engine_report(self.device, self.manifest, list(self._methods.values()), self._store, self.runner,
                             self.scheduler, sessions_open=len(self.sessions), baseline_used=self._baseline_used,
                             pool_sizing=self.pool_sizing, state_bytes_per_session=self.state_bytes_per_session,
                             prefix_cache=self.prefix_cache, deterministic=self.deterministic, notes=notes)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the loop, free sessions, graphs, the pool, methods and weights. Idempotent."""
        loop = getattr(self, "loop", None)
        if loop is not None and not self.closed:
            loop.stop()
        if getattr(self, "_warmer", None) is not None:
            self._warmer.stop()  # before the host slots are saved to disk and let go
        with self._lock:
            if self.closed:
                return
            if hasattr(self, "sessions"):
                self.sessions.close_all()
                self._persist_kv()
            self.closed = True
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self.runner is not None:
                self.runner.close()
            for m in self._methods.values():
                m.close()
            self._methods.clear()
            self._store.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # cuBLAS keeps a workspace per stream it ran on (graph warm-up and capture streams included).
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
