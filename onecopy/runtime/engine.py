"""The Engine: one bundle loaded on one device, its weights held once, a state pool for its sessions."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from ..bundle import Manifest, read_bundle
from ..errors import EngineClosedError, InputError, SessionCapacityError
from ..sampling import BatchSampler, DrawPlan, SamplingParams, to_device
from ..tokenizer import Tokenizer
from .graphs import DecodeGraphs
from .memory import MemoryReport, available_bytes, device_used
from .method import Method
from .pool import StatePool
from .scheduler import Scheduler, TokenStream
from .session import Session
from .state import SessionSnapshot
from .step import DecodeStep, default_buckets, runs_one_row_per_call
from .weights import WeightStore
from .workspace import Workspace

CPU_DEFAULT_SESSIONS = 8  # pool rows on CPU unless max_sessions or memory_budget say otherwise
CUDA_MAX_SESSIONS = 256  # cap on the rows sized from free GPU memory (and on the largest decode graph)
DEFAULT_PREFILL_CHUNK = 512


def gpu_reserve(total_bytes: int) -> int:
    """GPU memory kept free for activations, graphs and workspaces when sizing the state pool."""
    return max(512 * 2**20, total_bytes // 20)


def default_reserve(device: torch.device) -> int:
    if device.type == "cuda":
        return gpu_reserve(torch.cuda.get_device_properties(device).total_memory)
    return 1 << 30


def size_pool(row_bytes: int, device: torch.device, *, max_sessions: int | None, memory_budget: int | None,
              memory_fraction: float, reserve: int) -> tuple[int, str]:
    """How many session rows the pool gets, and why (said in the memory report).

    ``max_sessions`` is taken as asked (refused if it does not fit); otherwise CUDA takes
    ``memory_fraction`` of the device's memory minus what is in use and the reserve (like vLLM's
    gpu_memory_utilization), up to CUDA_MAX_SESSIONS, and CPU takes CPU_DEFAULT_SESSIONS.
    ``memory_budget`` bounds the pool's bytes in every case.
    """
    per = row_bytes or 1
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        room = min(free, int(total * memory_fraction) - (total - free)) - reserve
        where = f"{memory_fraction:.2f} of device memory after what is in use and a {reserve / 2**20:,.0f} MiB reserve"
    else:
        room = available_bytes(device) - reserve
        where = f"available host memory after a {reserve / 2**20:,.0f} MiB reserve"
    if memory_budget is not None:
        room, where = min(room, memory_budget), f"memory_budget={memory_budget} bytes"
    fits = max(room, 0) // per - 1  # one row is scratch
    if max_sessions is not None:
        if max_sessions > fits:
            raise SessionCapacityError(
                f"max_sessions={max_sessions} needs {(max_sessions + 1) * per} bytes of state pool ({per} per session "
                f"plus a scratch row) but {where} leaves room for {max(fits, 0)}; ask for fewer sessions, export with a "
                "smaller --max-seq-len, or free memory")
        return max_sessions, f"max_sessions={max_sessions}"
    if fits < 1:
        raise SessionCapacityError(f"no session fits: one needs {2 * per} bytes of state pool (its row and a scratch row) "
                                   f"and {where} leaves {max(room, 0)}; export with a smaller --max-seq-len or free memory")
    if memory_budget is not None:
        return fits, f"{fits} rows fit in {where}"
    if device.type == "cuda":
        rows = min(fits, CUDA_MAX_SESSIONS)
        why = f"capped at {CUDA_MAX_SESSIONS}; " if rows < fits else ""
        return rows, f"{rows} rows from free GPU memory ({why}{fits} fit in {where})"
    rows = min(fits, CPU_DEFAULT_SESSIONS)
    return rows, f"{rows} rows: the CPU default (pass max_sessions or memory_budget to change it)"


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
    """Owns the weight store, the loaded methods, the state pool and the scheduler. Create with `Engine.load`."""

    def __init__(self, path: Path, manifest: Manifest, device: torch.device, methods: dict[str, Method],
                 store: WeightStore, baseline_used: int) -> None:
        self.path, self.manifest, self.device = path, manifest, device
        self._methods, self._store = methods, store
        self._baseline_used = baseline_used
        self._sessions: dict[int, Session] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self._tokenizer: Tokenizer | None = None
        self.closed = False
        self.workspace = Workspace()
        self._pool: StatePool
        self._sampler: BatchSampler
        self._step: DecodeStep | None = None
        self.scheduler: Scheduler
        self.pool_sizing = ""
        self.deterministic = False
        self.fail_closed_reason: str | None = None
        self._mutated_initial: dict[str, torch.Tensor] = {}  # constants written in place (fail-closed bundles)
        self._row_index: torch.Tensor  # pool row ids on the device: one session's rows input is a view

    @classmethod
    def load(cls, bundle_dir: str | Path, device: str | torch.device = "cpu", *, max_sessions: int | None = None,
             memory_budget: int | None = None, memory_fraction: float = 0.9, reserve_bytes: int | None = None,
             cuda_graphs: bool | None = None, deterministic: bool = False, decode_buckets: Sequence[int] | None = None,
             prefill_chunk: int | None = None, max_queue: int | None = None, max_batch: int | None = None) -> "Engine":
        """Validate the whole bundle, load each method and each needed weight once, allocate the state pool.

        ``max_sessions``: rows of the state pool (sessions open at once); by default sized from
        free memory on CUDA (``memory_fraction`` of the device after what is in use and
        ``reserve_bytes``, at most 256) and 8 on CPU; ``memory_budget`` bounds the pool's bytes.
        ``memory_report().pool_sizing`` says which rule applied.
        ``cuda_graphs`` (default: on for CUDA) captures decode once per batch size in
        ``decode_buckets`` (default 1, 2, 4, ... up to the pool size); steps run padded to the next
        bucket with graphs, and eagerly too when ``decode_buckets`` is given. ``deterministic``: a session's logits, tokens and
        state are the same bit for bit whatever its row, the pool size and the sessions sharing its
        steps: steps run the bundle's batch-invariant decode (CUDA bundles, `models.invariant`) batched,
        or its decode one row per call (CPU; `runtime.step`). The default loads the fastest decode
        (the BLAS GEMM on CPU, cuBLAS past 16 rows on CUDA), batched. ``prefill_chunk`` (default 512)
        bounds the prompt tokens one prefill call takes; ``max_queue`` bounds requests waiting for a
        row (QueueFullError beyond; default unbounded); ``max_batch`` caps the sessions one decode
        step takes (1 interleaves sessions one step each, the unbatched baseline).
        Raises a BundleError subclass, InputError or SessionCapacityError, and then holds nothing.
        """
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise InputError("device='cuda' asked for but no CUDA GPU is visible; load with device='cpu'")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.init()
        if cuda_graphs and dev.type != "cuda":
            raise InputError("cuda_graphs=True needs a CUDA device; load with device='cuda' or cuda_graphs=False")
        if max_sessions is not None and max_sessions < 1:
            raise InputError(f"max_sessions must be >= 1, got {max_sessions}")
        if not 0 < memory_fraction <= 1:
            raise InputError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        baseline = device_used(dev)
        bundle = read_bundle(Path(bundle_dir), dev.type)
        manifest = bundle.manifest
        methods: dict[str, Method] = {}
        store = WeightStore(dev)
        engine = None
        try:
            for name in methods_to_load(manifest, deterministic):
                methods[name] = Method(manifest.methods[name], bundle.package_path(name), dev)
            store.load(bundle, {f for m in methods.values() if not m.embeds_weights for f in m.weight_fqns})
            for m in methods.values():
                m.bind_weights(store)
            engine = cls(Path(bundle_dir), manifest, dev, methods, store, baseline)
            mutated = sorted({c for m in methods.values() for c in m.spec.mutated_constants})
            if mutated:
                engine.fail_closed_reason = (
                    f"methods write the constants {mutated[:3]} in place, so sessions would share them: capacity is 1. "
                    "Re-export the bundle with onecopy to serve several sessions")
                engine._mutated_initial = {f: bundle.weights[f].clone() for f in mutated if f in bundle.weights}
                max_sessions, deterministic = 1, False
            engine._setup(max_sessions, memory_budget, memory_fraction,
                          default_reserve(dev) if reserve_bytes is None else reserve_bytes, cuda_graphs, deterministic,
                          decode_buckets, prefill_chunk, max_queue, max_batch)
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
        if engine.fail_closed_reason:
            warnings.warn(f"bundle {bundle_dir}: {engine.fail_closed_reason}", stacklevel=2)
        if any(m.embeds_weights for m in methods.values()):
            warnings.warn(f"bundle {bundle_dir} has methods that carry their own weights "
                          f"({engine.memory_report().duplicated_weight_bytes} duplicated bytes); "
                          "export it again with onecopy to share one copy", stacklevel=2)
        return engine

    def _setup(self, max_sessions: int | None, memory_budget: int | None, memory_fraction: float, reserve: int,
               cuda_graphs: bool | None, deterministic: bool, decode_buckets: Sequence[int] | None,
               prefill_chunk: int | None, max_queue: int | None, max_batch: int | None) -> None:
        """Allocate the pool, the sampler state and the decode step, then capture the graphs."""
        m = self.manifest
        if not m.state:
            raise InputError(f"bundle {self.path} declares no session state; this onecopy serves stateful methods")
        decode = self._role("decode")
        if cuda_graphs and (decode is None or decode.embeds_weights):
            raise InputError(f"cuda_graphs=True needs a 'decode' method bound to the shared weights; bundle "
                             f"{self.path} has {', '.join(self._methods)}: load it with cuda_graphs=False")
        vocab = m.config["vocab_size"]
        row_bytes = sum(s.nbytes for s in m.state.values())
        # The sampler keeps up to three bool [rows, vocab] tables: count them with the row.
        rows, self.pool_sizing = size_pool(row_bytes + 3 * vocab, self.device, max_sessions=max_sessions,
                                           memory_budget=memory_budget, memory_fraction=memory_fraction,
                                           reserve=reserve)
        self._pool = StatePool(m.state, rows, self.device)
        # Row ids spaced 16 bytes apart: a one-row view stays 16-byte aligned, as the packages were compiled for
        # (an unaligned input is copied by AOTI on every call).
        self._row_index = torch.arange(rows + 1, device=self.device).repeat_interleave(2)
        self._arange = torch.arange(m.max_seq_len, device=self.device)  # prefill contexts are views of it
        self._sampler = BatchSampler(rows + 1, vocab, self.device)
        self.deterministic = deterministic
        if decode_buckets is not None and (not decode_buckets or min(decode_buckets) < 1 or max(decode_buckets) > rows):
            raise InputError(f"decode_buckets must be batch sizes in 1..{rows} (the pool's rows), got {list(decode_buckets)}")
        buckets = sorted(set(decode_buckets)) if decode_buckets else default_buckets(rows)
        if decode_buckets and max(buckets) < rows:
            buckets.append(rows)  # a step of every session must fit some graph
        if decode is not None:
            self._step = DecodeStep(decode, self._pool, self.workspace, buckets=buckets, pad=decode_buckets is not None,
                                    one_row_per_call=runs_one_row_per_call(decode.spec, deterministic))
            use_graphs = self.device.type == "cuda" and not decode.embeds_weights if cuda_graphs is None else cuda_graphs
            if use_graphs:
                self._step.graphs = DecodeGraphs(decode.spec, self.path / decode.spec.package, self.device, self._store,
                                                 self._step.buckets, self._step.inputs, torch.cuda.Stream(self.device))
        chunk = min(prefill_chunk or DEFAULT_PREFILL_CHUNK, self.prefill_bound)
        self.scheduler = Scheduler(self, prefill_chunk=chunk, max_queue=max_queue, max_batch=max_batch)

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
        return int(self.manifest.config["vocab_size"])

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
    def max_sessions(self) -> int:
        """Rows of the state pool: the most sessions open at once."""
        return self._pool.rows

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.manifest.generation.get("eos_token_ids") or [])

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            t = self.manifest.tokenizer
            self._tokenizer = Tokenizer.from_file(self.path / t["file"], self.manifest.generation.get("chat_template"),
                                                  t.get("bos_token_id"))
        return self._tokenizer

    @property
    def weights(self) -> WeightStore:
        return self._store

    @property
    def state_bytes_per_session(self) -> int:
        """Sum of the state tensors' bytes one session owns (one pool row)."""
        return self._pool.row_bytes

    @property
    def session_bytes(self) -> int:
        return self._pool.row_bytes

    @property
    def graph_buckets(self) -> list[int]:
        """Batch sizes with a captured decode graph (empty without graphs)."""
        return self._step.graphs.buckets if self._step is not None and self._step.graphs is not None else []

    @property
    def cuda_graphs(self) -> bool:
        return bool(self.graph_buckets)

    # -- input checks --------------------------------------------------------------------------
    def check_token_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as ints, each in [0, vocab_size); InputError naming the first bad one otherwise."""
        out = []
        vocab = self.vocab_size
        for i, t in enumerate(ids):
            try:
                v = int(t)
            except (TypeError, ValueError):
                raise InputError(f"token #{i} is {t!r}, not an integer token id") from None
            if not 0 <= v < vocab or v != t:
                raise InputError(f"token id {t!r} at index {i} is outside the vocabulary [0, {vocab}); "
                                 "check the tokenizer matches this bundle")
            out.append(v)
        return out

    def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = True) -> list[int]:
        """Token ids of a text prompt (through the chat template unless ``chat=False``) or of given ids."""
        if isinstance(prompt, str):
            tok = self.tokenizer
            text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
            return tok.encode(text)
        return self.check_token_ids(prompt)

    # -- sessions ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this Engine is closed; load the bundle again with Engine.load")

    def capacity(self) -> int:
        """How many more sessions can be opened now: the pool's free rows."""
        self._check_open()
        return self._pool.free_rows

    def open_session(self, restore: SessionSnapshot | str | Path | None = None) -> Session:
        """Take a free row of the state pool (zeroed) for a new session; SessionCapacityError when none is free.

        ``restore`` (a snapshot or a file written by `Session.save`) continues that conversation.
        """
        snap = SessionSnapshot.load(restore) if isinstance(restore, (str, Path)) else restore
        with self._lock:
            self._check_open()
            if self._pool.free_rows == 0:
                raise self._capacity_error()
            session = Session(self, self._next_id, self._pool.acquire())
            self._next_id += 1
            self._sessions[session.id] = session
            if snap is not None:
                try:
                    session._restore(snap)
                except BaseException:
                    self._close_session(session)
                    raise
            for fqn, init in self._mutated_initial.items():  # fail-closed: each session starts from clean constants
                self._store.get(fqn).copy_(init)
            return session

    def _capacity_error(self) -> SessionCapacityError:
        extra = f" ({self.fail_closed_reason})" if self.fail_closed_reason else ""
        return SessionCapacityError(
            f"cannot open another session: all {self._pool.rows} rows of the state pool are in use "
            f"({self.pool_sizing}; {self._pool.row_bytes} bytes each){extra}. Close a session, or load the engine "
            "with a larger max_sessions (export with a smaller --max-seq-len to fit more)")

    def _close_session(self, session: Session) -> None:
        with self._lock:
            session._kept.clear()
            session.closed = True
            self._sessions.pop(session.id, None)
            if not self.closed:
                self._sampler.release(session.row)
                self._pool.release(session.row)
        if not self.closed:
            self.scheduler._wake()  # a waiting request may take the row

    @property
    def sessions_open(self) -> int:
        return len(self._sessions)

    # -- running methods (callers hold the lock or take it here) --------------------------------
    def _rows(self, row: int) -> torch.Tensor:
        """The int64 [1] rows input for one session: an aligned view, no host-to-device copy."""
        return self._row_index[2 * row:2 * row + 1]

    def _pools(self, method: Method) -> list[torch.Tensor]:
        return [self._pool.tensors[f] for f in method.spec.state]

    def _takes_context(self, method: Method) -> bool:
        return method.role == "prefill" and [i.name for i in method.spec.inputs][2:] == ["context"]

    def _run(self, session: Session, name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Run ``name`` eagerly on the session's row (the checked, one-session path)."""
        method = self.method(name)
        if self._takes_context(method) and len(inputs) == 2 and isinstance(inputs[1], torch.Tensor) and inputs[1].numel():
            last = int(inputs[1].max())  # the context a chunk attends to ends at its last position
            inputs = (*inputs, self._arange[:last + 1] if 0 <= last < self.max_seq_len else torch.arange(last + 1))
        method.check_inputs(inputs)
        if method.role == "decode" and inputs[0].shape[0] != 1:
            raise InputError(f"{name} on one session takes a batch of 1, got {inputs[0].shape[0]}; "
                             "batches of sessions go through the scheduler")
        with self._lock:
            self._check_open()
            with torch.inference_mode():
                return method(*inputs, self._rows(session.row), *self._pools(method))

    def _prefill_chunk(self, session: Session, ids: list[int]) -> torch.Tensor:
        """Prefill one chunk of checked ids at the session's position; advances it; logits [1, vocab]."""
        method = self._role("prefill")
        start = session.position
        tokens = to_device(torch.tensor([ids], dtype=torch.long), self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)
        context = (self._arange[:start + len(ids)],) if self._takes_context(method) else ()
        with torch.inference_mode():
            logits = method(tokens, positions, *context, self._rows(session.row), *self._pools(method))
        session.position += len(ids)
        return logits

    def _decode(self, rows: list[int], positions: list[int], tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One batched decode step (see DecodeStep): logits [n, vocab]."""
        if self._step is None:
            raise InputError(f"bundle {self.path} has no decode method; it has {', '.join(self._methods)}")
        return self._step(rows, positions, tokens)

    def _encode(self, session: Session, inputs: tuple[torch.Tensor, ...]) -> None:
        method = self._role("encode")
        with torch.inference_mode():
            method(*inputs, self._rows(session.row), *self._pools(method))

    def _set_last_tokens(self, rows: list[int], ids: list[int]) -> None:
        packed = to_device(torch.tensor([rows, ids], dtype=torch.long), self.device)
        self._step.last_token.index_copy_(0, packed[0], packed[1])

    def _store_last_tokens(self, plan: DrawPlan, tokens: torch.Tensor) -> None:
        self._step.last_token.index_copy_(0, plan.ints[0], tokens)

    # -- requests ------------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, chat: bool = True,
               session: Session | None = None, stop_ids: Sequence[int] | None = None) -> TokenStream:
        """Queue a generation request with the scheduler; returns its `TokenStream` (iterate or ``async for``).

        Text prompts go through the chat template unless ``chat=False``. Without ``session`` the
        request takes a free row when one is (waiting in the queue until then) and frees it at the end.
        """
        return self.scheduler.submit(self.encode_prompt(prompt, chat=chat), params, session=session, stop_ids=stop_ids)

    # -- accounting ----------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Weights (unique, resident, duplicated), the state pool, graphs and device-level use of this Engine."""
        self._check_open()
        weights = self.manifest.weights
        needed = {f for m in self._methods.values() for f in m.weight_fqns}
        unique = sum(weights[f].nbytes for f in needed)
        embedded = sum(weights[f].nbytes for m in self._methods.values() if m.embeds_weights for f in m.weight_fqns)
        resident = self._store.nbytes + embedded
        notes = []
        if embedded:
            names = [m.name for m in self._methods.values() if m.embeds_weights]
            notes.append(f"methods {names} carry their own weights (fallback path): re-export to share one copy")
        if self.fail_closed_reason:
            notes.append(self.fail_closed_reason)
        used = device_used(self.device)
        graphs = self._step.graphs if self._step is not None else None
        return MemoryReport(device=str(self.device), unique_weight_bytes=unique, resident_weight_bytes=resident,
                            duplicated_weight_bytes=resident - unique,
                            state_bytes=len(self._sessions) * self._pool.row_bytes,
                            sessions_open=len(self._sessions), state_bytes_per_session=self._pool.row_bytes,
                            device_used_bytes=used - self._baseline_used, device_total_used_bytes=used,
                            capacity=self._pool.free_rows, pool_rows=self._pool.rows, pool_bytes=self._pool.nbytes,
                            pool_sizing=self.pool_sizing, sampler_bytes=self._sampler.nbytes,
                            graph_buckets=self.graph_buckets, graph_bytes=graphs.device_bytes if graphs else 0,
                            workspace_bytes=self.workspace.nbytes, deterministic=self.deterministic, notes=notes)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the scheduler, free sessions, graphs, the pool, methods and weights. Idempotent."""
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None and not self.closed:
            scheduler.stop()
        with self._lock:
            if self.closed:
                return
            for s in list(self._sessions.values()):
                s._kept.clear()
                s.closed = True
            self._sessions.clear()
            self.closed = True
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if self._step is not None and self._step.graphs is not None:
                self._step.graphs.release()
            self._step = None
            self.workspace.clear()
            if hasattr(self, "_pool"):
                self._pool.release_memory()
                self._sampler.clear()
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
