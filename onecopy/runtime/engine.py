"""The Engine: one bundle loaded on one device, its weights held once, a state pool for its sessions.

A facade over three parts with one job each: the `runner.ModelRunner` (methods, pool, decode step,
graphs, sampler), the `scheduler.Scheduler` (pure policy over requests) and the `loop.EngineLoop`
(the thread that drives them and feeds the streams). The engine loads, opens and closes sessions,
checks and submits requests, and reports memory.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from ..bundle import Manifest, parse_dtype, read_bundle
from ..errors import EngineClosedError, EngineFailedError, InputError, PromptTooLongError, SessionCapacityError
from ..sampling import SamplingParams
from ..tokenizer import Tokenizer
from .loop import EngineLoop, TokenStream
from .memory import MemoryReport, available_bytes, device_used
from .method import Method
from .runner import ModelRunner
from .scheduler import Request, Scheduler
from .session import Session
from .state import SessionSnapshot
from .weights import WeightStore

log = logging.getLogger("onecopy.engine")

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


def gpu_room(device: torch.device, memory_fraction: float, reserve: int) -> int:
    """Bytes the state may take on a GPU: ``memory_fraction`` of it after what is in use and ``reserve``."""
    free, total = torch.cuda.mem_get_info(device)
    return min(free, int(total * memory_fraction) - (total - free)) - reserve


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
        room = gpu_room(device, memory_fraction, reserve)
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


def size_blocks(rows: int, why: str, manifest: Manifest, fixed_row_bytes: int, device: torch.device, *,
                kv_blocks: int | None, sized_by_user: bool, memory_fraction: float, reserve: int) -> tuple[int, int, str]:
    """(rows, KV blocks, why) for a paged bundle, from the rows `size_pool` gave at full length.

    By default every row can fill max_seq_len (``rows`` x the table width); on CUDA with nothing asked
    the blocks take the free memory instead, with CUDA_MAX_SESSIONS rows: sessions that share a prompt
    or stop early then fit beyond that count. ``kv_blocks`` sets the blocks itself.
    """
    paged = manifest.paged_state
    block_bytes = sum(manifest.state[f].nbytes for f in paged)
    width = manifest.table_width
    if kv_blocks is not None:
        if kv_blocks < 1:
            raise InputError(f"kv_blocks must be >= 1, got {kv_blocks}")
        return rows, kv_blocks, f"{why}; kv_blocks={kv_blocks}"
    if device.type == "cuda" and not sized_by_user:
        room = gpu_room(device, memory_fraction, reserve)
        rows = CUDA_MAX_SESSIONS
        blocks = (room - (rows + 1) * fixed_row_bytes) // block_bytes - 1
        if blocks < width:
            raise SessionCapacityError(f"one session at max_seq_len needs {width} KV blocks of {block_bytes} bytes and "
                                       f"free GPU memory holds {max(blocks, 0)}; export with a smaller --max-seq-len")
        return rows, blocks, (f"{rows} rows, {blocks} KV blocks ({blocks * manifest.kv_block_size} positions) from "
                              f"{memory_fraction:.2f} of GPU memory after what is in use and the reserve")
    return rows, rows * width, f"{why}; {rows * width} KV blocks: every row can reach max_seq_len"


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
    """Owns the weight store, the model runner, the scheduler and its loop. Create with `Engine.load`."""

    def __init__(self, path: Path, manifest: Manifest, device: torch.device, methods: dict[str, Method],
                 store: WeightStore, baseline_used: int) -> None:
        self.prefix_cache = False  # shared prompt blocks (`runtime.prefix`); see prefix_cache_note
        self.prefix_cache_note = ""
        self._prefilling: list[Request] = []  # admitted fresh requests whose prompt is not all published yet
        self.path, self.manifest, self.device = path, manifest, device
        self._methods, self._store = methods, store
        self._baseline_used = baseline_used
        self._sessions: dict[int, Session] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self._tokenizer: Tokenizer | None = None
        self.closed = False
        self.runner: ModelRunner | None = None
        self.scheduler: Scheduler
        self.loop: EngineLoop
        self.pool_sizing = ""
        self.deterministic = False
        self.fail_closed_reason: str | None = None
        self._mutated_initial: dict[str, torch.Tensor] = {}  # constants written in place (fail-closed bundles)

    @classmethod
    def load(cls, bundle_dir: str | Path, device: str | torch.device = "cpu", *, max_sessions: int | None = None,
             memory_budget: int | None = None, memory_fraction: float = 0.9, reserve_bytes: int | None = None,
             cuda_graphs: bool | None = None, deterministic: bool = False, decode_buckets: Sequence[int] | None = None,
             prefill_chunk: int | None = None, max_queue: int | None = None, max_batch: int | None = None,
             prefix_cache: bool = True, kv_blocks: int | None = None, token_budget: int | None = None) -> "Engine":
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
        step takes (1 interleaves sessions one step each, the unbatched baseline). ``token_budget``
        (default None: one prefill chunk per iteration): tokens one iteration may take, a decoding
        session counting one and a prefill chunk its length; the oldest prompt's chunk always runs, and
        the next prompts' whole chunks join while the budget lasts, so a burst of prompts gets into the
        state in fewer iterations while every decoding session still advances each one. Chunks are cut
        the same whatever the budget (a prompt's bits never depend on it). Bundles without a prefill
        method (prompts go through decode) ignore it.
        ``prefix_cache`` (bundles with paged KV): a request starts on the KV blocks of the longest cached
        prefix of its prompt (another session's prompt, a finished conversation) and prefills only the
        rest; off in deterministic mode (prefilling the rest from another cut gives other bits) and for
        bundles without paged KV; ``memory_report().notes`` says why. ``kv_blocks``: KV blocks of the
        paged cache (default: every row can reach max_seq_len; on CUDA, the free memory).
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
                          decode_buckets, prefill_chunk, max_queue, max_batch, prefix_cache, kv_blocks, token_budget)
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
               prefill_chunk: int | None, max_queue: int | None, max_batch: int | None, prefix_cache: bool = False,
               kv_blocks: int | None = None, token_budget: int | None = None) -> None:
        """Size the pool, build the runner (pool, sampler, decode step, graphs), the scheduler and its loop."""
        m = self.manifest
        if not m.state:
            raise InputError(f"bundle {self.path} declares no session state; this onecopy serves stateful methods")
        decode = self._role("decode")
        if cuda_graphs and (decode is None or decode.embeds_weights):
            raise InputError(f"cuda_graphs=True needs a 'decode' method bound to the shared weights; bundle "
                             f"{self.path} has {', '.join(self._methods)}: load it with cuda_graphs=False")
        vocab = m.config["vocab_size"]
        paged = set(m.paged_state)
        # The sampler keeps up to three bool [rows, vocab] tables: count them with the row (and its block table).
        fixed = sum(s.nbytes for k, s in m.state.items() if k not in paged) + 3 * vocab + 8 * m.table_width
        full = fixed + m.table_width * sum(m.state[f].nbytes for f in paged)  # a session at max_seq_len
        rows, self.pool_sizing = size_pool(full, self.device, max_sessions=max_sessions,
                                           memory_budget=memory_budget, memory_fraction=memory_fraction,
                                           reserve=reserve)
        blocks = 0
        if paged:
            rows, blocks, self.pool_sizing = size_blocks(
                rows, self.pool_sizing, m, fixed, self.device, kv_blocks=kv_blocks,
                sized_by_user=max_sessions is not None or memory_budget is not None,
                memory_fraction=memory_fraction, reserve=reserve)
        self.deterministic = deterministic
        if not paged:
            self.prefix_cache_note = "prefix cache off: this bundle's state has a row per session (no paged KV)"
        elif not prefix_cache:
            self.prefix_cache_note = "prefix cache off (prefix_cache=False)"
        elif deterministic:
            self.prefix_cache_note = ("prefix cache off in deterministic mode: prefilling a prompt's rest after a "
                                      "cached prefix cuts it elsewhere, which changes bits")
        self.prefix_cache = bool(paged) and prefix_cache and not deterministic
        self.runner = ModelRunner(self.path, m, self.device, self._methods, self._store, rows,
                                  deterministic=deterministic, cuda_graphs=cuda_graphs, decode_buckets=decode_buckets,
                                  kv_blocks=blocks, prefix_cache=self.prefix_cache)
        log.info("%s on %s: %s; decode %s%s", self.path.name, self.device, self.pool_sizing,
                 decode.name if decode else "none",
                 f", graphs for {self.runner.graph_buckets}" if self.runner.graph_buckets else "")
        chunk = min(prefill_chunk or DEFAULT_PREFILL_CHUNK, self.prefill_bound)
        self.scheduler = Scheduler(self, max_seq_len=m.max_seq_len, has_prefill=self.has_prefill, prefill_chunk=chunk,
                                   max_queue=max_queue, max_batch=max_batch, token_budget=token_budget,
                                   blocks=self if self.runner.blocks is not None else None)
        # Overlap step t+1 with step t's ids on CUDA; not with recurrent state: the step queued after a
        # stop id would advance it for good.
        self.loop = EngineLoop(self.scheduler, self.runner, self._lock, on_finished=self._request_finished,
                               overlap=self.device.type == "cuda" and not self.recurrent_state,
                               recurrent_state=bool(self.recurrent_state))

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
    def lock(self) -> threading.RLock:
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
        return self.runner.pool.rows

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
        """Bytes of state one session holds at most: its pool row, and with paged KV its blocks at max_seq_len."""
        r = self.runner
        return r.pool.row_bytes + (r.blocks.width * r.blocks.block_bytes if r.blocks is not None else 0)

    @property
    def session_bytes(self) -> int:
        return self.state_bytes_per_session

    @property
    def graph_buckets(self) -> list[int]:
        """Batch sizes with a captured decode graph (empty without graphs)."""
        return self.runner.graph_buckets if self.runner is not None else []

    @property
    def failed(self) -> str | None:
        """Why the engine serves no more (a sticky device error), or None."""
        return self.loop.failed if hasattr(self, "loop") else None

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

    def check_prompt_fits(self, ids: Sequence[int], start: int) -> None:
        """InputError for an empty prompt, PromptTooLongError if ``ids`` after ``start`` tokens pass max_seq_len."""
        if not ids:
            raise InputError("prompt is empty; give at least one token")
        if start + len(ids) > self.max_seq_len:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens after {start} already in the session exceeds max_seq_len={self.max_seq_len}; "
                "shorten the prompt, reset the session, or export the bundle with a larger --max-seq-len")

    def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = True) -> list[int]:
        """Token ids of a text prompt (through the chat template unless ``chat=False``) or of given ids."""
        if isinstance(prompt, str):
            tok = self.tokenizer
            text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
            return tok.encode(text)
        return self.check_token_ids(prompt)

    # -- sessions ------------------------------------------------------------------------------
    def check_open(self) -> None:
        """EngineClosedError after close, EngineFailedError after a sticky device error."""
        if self.closed:
            raise EngineClosedError("this Engine is closed; load the bundle again with Engine.load")
        if self.failed:
            raise EngineFailedError(f"the engine failed and serves no more requests: {self.failed}; "
                                    "load the bundle again in a new process")

    def capacity(self) -> int:
        """How many more sessions can be opened now: the pool's free rows."""
        self.check_open()
        return self.runner.pool.free_rows

    @property
    def free_rows(self) -> int:
        """The pool's free rows (no checks: the scheduler's view)."""
        return self.runner.pool.free_rows if self.runner is not None else 0

    def open_session(self, restore: SessionSnapshot | str | Path | None = None) -> Session:
        """Take a free row of the state pool (zeroed) for a new session; SessionCapacityError when none is free.

        ``restore`` (a snapshot or a file written by `Session.save`) continues that conversation.
        """
        snap = SessionSnapshot.load(restore) if isinstance(restore, (str, Path)) else restore
        with self._lock:
            self.check_open()
            pool = self.runner.pool
            if pool.free_rows == 0:
                raise self._capacity_error()
            session = Session(self, self._next_id, pool.acquire())
            self._next_id += 1
            self._sessions[session.id] = session
            if snap is not None:
                try:
                    session.restore(snap)
                except BaseException:
                    self.release_session(session)
                    raise
            for fqn, init in self._mutated_initial.items():  # fail-closed: each session starts from clean constants
                self._store.get(fqn).copy_(init)
            return session

    def _capacity_error(self) -> SessionCapacityError:
        extra = f" ({self.fail_closed_reason})" if self.fail_closed_reason else ""
        pool = self.runner.pool
        return SessionCapacityError(
            f"cannot open another session: all {pool.rows} rows of the state pool are in use "
            f"({self.pool_sizing}; {self.state_bytes_per_session} bytes each){extra}. Close a session, or load the engine "
            "with a larger max_sessions (export with a smaller --max-seq-len to fit more)")

    def release_session(self, session: Session) -> None:
        """Zero a closed session's row and give it back (the session calls this; no request may run on it)."""
        with self._lock:
            session.mark_closed()
            self._sessions.pop(session.id, None)
            if not self.closed:
                self.runner.release(session.row)
                self.runner.pool.release(session.row)
                if self.runner.blocks is not None:
                    self.runner.blocks.release(session.row)
        if not self.closed:
            self.loop.wake()  # a waiting request may take the row

    def _request_finished(self, req: Request) -> None:
        """A request ended (on the loop, under the lock): detach it from its session, close the session
        if the scheduler opened it (unless kept) or its owner closed it while the request still ran."""
        session = req.session
        if session is None:
            return
        with session.attach_lock:
            if session._stream is req.stream:
                session._stream = None
            pending = session.close_pending
        kept = req.keep_session and req.finish_reason in ("stop", "length")
        if req in self._prefilling:
            self._prefilling.remove(req)
        blocks = self.runner.blocks
        if blocks is not None and not session.closed:
            held = req.base + req.prompt + req.stream.ids if req.base is not None and req.finish_reason != "error" else None
            session.tokens = held[:session.position] if held is not None else None
            if session.tokens is not None:
                blocks.publish(session.row, session.tokens)  # the conversation so far, for its next turn
            blocks.trim(session.row, session.position)  # what it reserved and did not write
        if (req.own_session and not kept) or pending:
            self.release_session(session)

    # -- KV blocks (the scheduler's BlockAdmission) ----------------------------------------------
    def _request_span(self, req: Request, start: int) -> int:
        """The end of the positions a request may write: its prompt and all but its last new token."""
        return max(start + len(req.prompt), min(start + len(req.prompt) + req.params.max_new_tokens - 1,
                                                self.max_seq_len))

    def _cached_prefix(self, req: Request, touch: bool) -> tuple[list[int], int]:
        """The cached blocks a fresh request's prompt starts with and the tokens it takes from them (at
        least one prompt token is left to prefill: its logits are the first sample)."""
        if not self.prefix_cache or not req.own_session:
            return [], 0
        blocks = self.runner.blocks
        found = blocks.lookup(req.prompt, touch)
        cached = min(len(found) * blocks.block_size, len(req.prompt) - 1)
        return found[:blocks.blocks_for(cached)], cached

    def fits(self, req: Request) -> bool:
        """Whether the KV blocks a request needs are free or evictable now."""
        blocks = self.runner.blocks
        if not req.own_session:
            s = req.session
            return blocks.cost(s.row, s.position, self._request_span(req, s.position)) <= blocks.available
        shared, cached = self._cached_prefix(req, touch=False)
        if self.prefix_cache and any(self._common_blocks(p.prompt, req.prompt) > len(shared) for p in self._prefilling):
            return False  # a prompt being prefilled now holds more of it: wait and share its blocks
        need = blocks.blocks_for(self._request_span(req, 0)) - len(shared) + (1 if cached % blocks.block_size else 0)
        return need <= blocks.available - sum(1 for b in shared if blocks.refs[b] == 0)

    def _common_blocks(self, a: list[int], b: list[int]) -> int:
        """Full blocks two prompts share from their start (b's last token excluded: it is always prefilled)."""
        bs, n = self.runner.blocks.block_size, 0
        while (n + 1) * bs <= min(len(a), len(b) - 1) and a[n * bs:(n + 1) * bs] == b[n * bs:(n + 1) * bs]:
            n += 1
        return n

    def place(self, req: Request) -> None:
        """Give an admitted request its blocks: a fresh session starts on the cached prefix of its prompt."""
        blocks, session = self.runner.blocks, req.session
        if req.own_session:
            shared, req.cached = self._cached_prefix(req, touch=True)
            blocks.share(session.row, shared)
            session.position, session.tokens = req.cached, list(req.prompt[:req.cached])
            req.stream.cached_tokens = req.cached
            if self.prefix_cache:
                self._prefilling.append(req)
        req.base = list(session.tokens[:session.position - req.cached]) if session.tokens is not None else None
        blocks.prepare(session.row, session.position, self._request_span(req, session.position - req.cached))

    def prefilled(self, req: Request) -> None:
        """A request's prompt is in its session (queued): later prompts may start on its blocks."""
        if req in self._prefilling:
            self._prefilling.remove(req)
        if self.prefix_cache and req.base is not None:
            req.session.tokens = req.base + req.prompt
            self.runner.blocks.publish(req.session.row, req.session.tokens)

    @property
    def sessions_open(self) -> int:
        return len(self._sessions)

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
        ids) end the request after being emitted. ``encode_inputs`` run through the encode method
        on the row before the prompt (e.g. audio features for a speech model). Raises InputError /
        PromptTooLongError for bad input, QueueFullError when ``max_queue`` requests already wait,
        EngineClosedError after close, EngineFailedError after a device error.
        """
        self.check_open()
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt, chat=chat)
        start = 0
        if session is not None:
            session.check_open()
            if session.engine is not self:
                raise InputError(f"session {session.id} belongs to another engine")
            start = session.position
        self.check_prompt_fits(ids, start)
        if encode_inputs is not None:
            encode_inputs = tuple(encode_inputs)
            self.method(self.role_method("encode")).check_inputs(encode_inputs)
        stop = frozenset(self.eos_token_ids if stop_ids is None else stop_ids)
        req = Request(0, ids, params, stop, session, own_session=session is None, keep_session=keep_session,
                      encode_inputs=encode_inputs)
        blocks = self.runner.blocks
        span = self._request_span(req, start) if blocks is not None else 0
        if blocks is not None and blocks.blocks_for(span) > blocks.blocks:
            raise SessionCapacityError(
                f"the request may write {span} positions ({blocks.blocks_for(span)} KV blocks of "
                f"{blocks.block_size}) and the whole KV cache has {blocks.blocks} blocks; ask for fewer max_new_tokens "
                "or a shorter prompt, or load the engine with more kv_blocks")
        return self.loop.submit(req)

    # -- accounting ----------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Weights (unique, resident, duplicated), the state pool, graphs and device-level use of this Engine."""
        self.check_open()
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
        if self.prefix_cache_note:
            notes.append(self.prefix_cache_note)
        used = device_used(self.device)
        r = self.runner
        graphs = r.step.graphs if r.step is not None else None
        kv = {}
        state_bytes = len(self._sessions) * r.pool.row_bytes
        if r.blocks is not None:
            b, use = r.blocks, r.blocks.usage()
            kv = dict(kv_block_size=b.block_size, kv_blocks=b.blocks, kv_dtype=self.manifest.kv_dtype_description(),
                      kv_block_bytes=b.block_bytes, kv_shared_bytes=use["shared"] * b.block_bytes,
                      kv_private_bytes=use["private"] * b.block_bytes, kv_evictable_bytes=use["cached"] * b.block_bytes,
                      kv_free_bytes=use["free"] * b.block_bytes, kv_references=use["references"],
                      prefix_cache=self.prefix_cache, prefix_cached_tokens=self.scheduler.stats.cached_tokens)
            state_bytes += (use["shared"] + use["private"]) * b.block_bytes
        m = self.manifest
        packed = {f for name in m.packed for f in m.packed_fqns(name)} & set(needed)
        packed_values = sum(p["shape"][0] * p["shape"][1] for p in m.packed.values())
        return MemoryReport(device=str(self.device), unique_weight_bytes=unique, resident_weight_bytes=resident,
                            duplicated_weight_bytes=resident - unique,
                            packed_weight_bytes=sum(weights[f].nbytes for f in packed),
                            packed_as_float_bytes=packed_values * parse_dtype(m.dtype).itemsize,
                            state_bytes=state_bytes,
                            sessions_open=len(self._sessions), state_bytes_per_session=self.state_bytes_per_session,
                            device_used_bytes=used - self._baseline_used, device_total_used_bytes=used,
                            capacity=r.pool.free_rows, pool_rows=r.pool.rows,
                            pool_bytes=r.pool.nbytes + (r.blocks.nbytes if r.blocks is not None else 0),
                            pool_sizing=self.pool_sizing, sampler_bytes=r.sampler.nbytes,
                            graph_buckets=self.graph_buckets, graph_bytes=graphs.device_bytes if graphs else 0,
                            workspace_bytes=r.workspace.nbytes, deterministic=self.deterministic, notes=notes, **kv)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the loop, free sessions, graphs, the pool, methods and weights. Idempotent."""
        loop = getattr(self, "loop", None)
        if loop is not None and not self.closed:
            loop.stop()
        with self._lock:
            if self.closed:
                return
            for s in list(self._sessions.values()):
                s.mark_closed()
            self._sessions.clear()
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
