"""The Engine: one bundle loaded on one device, its weights held once, serving isolated sessions."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import torch

from ..bundle import Manifest, read_bundle
from ..errors import EngineClosedError, InputError, SessionCapacityError
from ..tokenizer import Tokenizer
from .memory import MemoryReport, available_bytes, device_used
from .graphs import GraphSlot
from .method import Method
from .session import Session
from .state import SessionSnapshot, SessionState, state_layout
from .weights import WeightStore
from .workspace import Workspace


def gpu_reserve(total_bytes: int) -> int:
    """GPU memory kept free for activations and workspaces when sizing session capacity."""
    return max(512 * 2**20, total_bytes // 20)


def default_reserve(device: torch.device) -> int:
    if device.type == "cuda":
        return gpu_reserve(torch.cuda.get_device_properties(device).total_memory)
    return 1 << 30


class Engine:
    """Owns the weight store, the loaded methods and the open sessions. Create with `Engine.load`."""

    def __init__(self, path: Path, manifest: Manifest, device: torch.device, methods: dict[str, Method],
                 store: WeightStore, baseline_used: int, max_sessions: int | None, memory_budget: int | None,
                 reserve_bytes: int, fail_closed: str | None, undeclared_state: dict[str, torch.Tensor],
                 cuda_graphs: bool) -> None:
        self.path, self.manifest, self.device = path, manifest, device
        self._methods, self._store = methods, store
        self._baseline_used = baseline_used
        self._sessions: dict[int, Session] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self._tokenizer: Tokenizer | None = None
        self.max_sessions = 1 if fail_closed else max_sessions
        self.memory_budget, self.reserve_bytes = memory_budget, reserve_bytes
        self.fail_closed_reason = fail_closed
        self._undeclared_state = undeclared_state  # initial values of buffers mutated but not declared
        self.session_bytes = state_layout(manifest.state)[1]
        self.closed = False
        # CUDA graphs: slots (state + captured decode) handed to sessions, all graphs in one pool.
        self.cuda_graphs = cuda_graphs
        self.workspace = Workspace()
        self._slots: list[GraphSlot] = []
        self._free_slots: list[GraphSlot] = []
        self._pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self._warmup_stream = torch.cuda.Stream(device) if cuda_graphs else None

    @classmethod
    def load(cls, bundle_dir: str | Path, device: str | torch.device = "cpu", *, max_sessions: int | None = None,
             memory_budget: int | None = None, reserve_bytes: int | None = None,
             cuda_graphs: bool | None = None) -> "Engine":
        """Validate the whole bundle, then load each method and each needed weight once.

        ``max_sessions`` caps open sessions; ``memory_budget`` (bytes) bounds session state (on
        CPU; default: available memory); ``reserve_bytes`` is kept free when sizing capacity.
        ``cuda_graphs`` (default: on for CUDA, off on CPU) replays decode from a graph captured per
        session slot. Raises a BundleError subclass (and holds nothing) if any check fails.
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
        baseline = device_used(dev)
        bundle = read_bundle(Path(bundle_dir), dev.type)
        manifest = bundle.manifest
        declared = set(manifest.state)
        mutated = {f for spec in manifest.methods.values() for f in spec.state}
        fail_closed = None
        if mutated != declared:
            fail_closed = (f"the manifest's state {sorted(declared - mutated)[:3]} / methods' mutations "
                           f"{sorted(mutated - declared)[:3]} differ, so sessions could share state: capacity is 1. "
                           "Re-export the bundle with onecopy to serve several sessions")
        methods: dict[str, Method] = {}
        store = WeightStore(dev)
        try:
            for name, spec in manifest.methods.items():
                methods[name] = Method(spec, bundle.package_path(name), dev, declared)
            needed = {f for m in methods.values() if not m.embeds_weights for f in m.weight_fqns}
            store.load(bundle, needed)
            undeclared = {f: bundle.weights[f].clone() for f in mutated - declared if f in bundle.weights}
        except BaseException:
            for m in methods.values():
                m.close()
            store.clear()
            raise
        finally:
            bundle.close()
        graphable = "decode" in methods and not methods["decode"].embeds_weights
        if cuda_graphs and not graphable:
            for m in methods.values():
                m.close()
            store.clear()
            raise InputError(f"cuda_graphs=True needs a 'decode' method bound to the shared weights; bundle "
                             f"{bundle_dir} has {', '.join(methods)}: load it with cuda_graphs=False")
        use_graphs = dev.type == "cuda" and graphable and not fail_closed if cuda_graphs is None else bool(cuda_graphs)
        engine = cls(Path(bundle_dir), manifest, dev, methods, store, baseline, max_sessions, memory_budget,
                     default_reserve(dev) if reserve_bytes is None else reserve_bytes, fail_closed, undeclared,
                     use_graphs)
        if use_graphs:
            try:  # the first slot is captured now, so its measured cost sizes capacity from the start
                engine._free_slots.append(engine._new_slot())
            except BaseException:
                engine.close()
                raise
        if fail_closed:
            warnings.warn(f"bundle {bundle_dir}: {fail_closed}", stacklevel=2)
        if any(m.embeds_weights for m in methods.values()):
            warnings.warn(f"bundle {bundle_dir} has methods that carry their own weights "
                          f"({engine.memory_report().duplicated_weight_bytes} duplicated bytes); "
                          "export it again with onecopy to share one copy", stacklevel=2)
        return engine

    # -- introspection -------------------------------------------------------------------------
    @property
    def methods(self) -> list[str]:
        """Names of the loaded methods."""
        return list(self._methods)

    def method(self, name: str) -> Method:
        if name not in self._methods:
            raise InputError(f"bundle has no method {name!r}; it has {', '.join(self._methods)}")
        return self._methods[name]

    @property
    def max_seq_len(self) -> int:
        return self.manifest.max_seq_len

    @property
    def prefill_bound(self) -> int:
        """Longest chunk one prefill call takes (1 when the bundle has no prefill: decode token by token)."""
        if "prefill" not in self._methods:
            return 1
        dim = self._methods["prefill"].spec.inputs[0].shape[1]
        return dim["max"] if isinstance(dim, dict) else dim

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
        """Sum of the state tensors' bytes one session owns."""
        return sum(s.nbytes for s in self.manifest.state.values())

    # -- sessions ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this Engine is closed; load the bundle again with Engine.load")

    def _free_for_sessions(self) -> int:
        """Bytes that new session state may still take, after the reserve."""
        if self.memory_budget is not None:
            return self.memory_budget - sum(s._state.nbytes for s in self._sessions.values())
        free = available_bytes(self.device)
        if self.device.type == "cuda":  # memory torch has cached but not handed out is free for us too
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return free - self.reserve_bytes

    @property
    def bytes_per_new_session(self) -> int:
        """Device bytes one more session takes: its state, plus a runner and graph when graphs are on."""
        if self.cuda_graphs and len(self._slots) > 1:
            # The first slot also grew the shared pool and workspaces once; later slots show the real cost.
            return max(s.device_bytes for s in self._slots[1:])
        if self.cuda_graphs:
            return -(-self.session_bytes // (2 << 20)) * (2 << 20)  # measured: later slots cost their state
        return self.session_bytes

    def capacity(self) -> int:
        """How many more sessions can be opened now (free memory after the reserve, and max_sessions)."""
        with self._lock:
            self._check_open()
            n = len(self._free_slots) + max(self._free_for_sessions(), 0) // max(self.bytes_per_new_session, 1)
            if self.max_sessions is not None:
                n = min(n, self.max_sessions - len(self._sessions))
            return max(n, 0)

    def open_session(self, restore: SessionSnapshot | str | Path | None = None) -> Session:
        """Open a session, its state allocated now (a memory error surfaces here, not mid-request).

        ``restore`` (a snapshot or a file written by `Session.save`) continues that conversation.
        Raises SessionCapacityError when no room is left.
        """
        snap = SessionSnapshot.load(restore) if isinstance(restore, (str, Path)) else restore
        with self._lock:
            self._check_open()
            if self.capacity() < 1:
                raise self._capacity_error()
            slot = None
            try:
                if self.cuda_graphs:
                    slot = self._free_slots.pop() if self._free_slots else self._new_slot()
                    state = slot.state
                else:
                    state = SessionState(self.manifest.state, self.device)
            except torch.OutOfMemoryError as e:
                raise self._capacity_error() from e
            session = Session(self, self._next_id, state)
            session._slot = slot
            self._next_id += 1
            if snap is not None:
                try:
                    session._restore(snap)
                except BaseException:
                    self._give_back(session)
                    raise
            self._sessions[session.id] = session
            self._reset_undeclared_state()
            return session

    def _capacity_error(self) -> SessionCapacityError:
        why = (f"max_sessions={self.max_sessions}" if self.max_sessions is not None
               and len(self._sessions) >= self.max_sessions else
               f"only {max(self._free_for_sessions(), 0)} bytes are free for state after a {self.reserve_bytes}-byte reserve")
        extra = f" ({self.fail_closed_reason})" if self.fail_closed_reason else ""
        return SessionCapacityError(
            f"cannot open another session: {len(self._sessions)} sessions are open, one more needs "
            f"{self.bytes_per_new_session} bytes of state, and {why}{extra}. Close a session, export with a smaller "
            "--max-seq-len, or load with a larger max_sessions/memory_budget")

    def _reset_undeclared_state(self) -> None:
        # Fail-closed bundles keep undeclared mutable buffers in the store: give each session a fresh copy.
        for fqn, init in self._undeclared_state.items():
            self._store.get(fqn).copy_(init)

    def _new_slot(self) -> GraphSlot:
        decode = self._methods["decode"]
        slot = GraphSlot(len(self._slots), decode.spec, self.path / decode.spec.package, self.device, self._store,
                         self.manifest.state, self.workspace, self._pool, self._warmup_stream)
        self._slots.append(slot)
        return slot

    def _give_back(self, session: Session) -> None:
        """Return a session's memory: its slot to the free list (graphs) or its state to the device."""
        if session._slot is not None:
            session._slot.state.zero_()
            self._free_slots.append(session._slot)
            session._slot = None
        else:
            session._state.release()  # runners still pointing here are rebound before their next run
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _close_session(self, session: Session) -> None:
        with self._lock:
            session._kept.clear()
            session.closed = True
            self._sessions.pop(session.id, None)
            self._give_back(session)

    def graph_slots(self) -> list[dict[str, float]]:
        """Per captured slot: capture time, device bytes, and bytes beyond its state (runner + graph)."""
        return [{"index": s.index, "capture_seconds": s.capture_seconds, "device_bytes": s.device_bytes,
                 "overhead_bytes": s.overhead_bytes, "in_use": s not in self._free_slots} for s in self._slots]

    @property
    def sessions_open(self) -> int:
        return len(self._sessions)

    def _run(self, session: Session, name: str, inputs: tuple[torch.Tensor, ...], own_output: bool = True) -> torch.Tensor:
        method = self.method(name)
        method.check_inputs(inputs)
        with self._lock:
            self._check_open()
            if name == "decode" and session._slot is not None:
                out = session._slot.replay(*inputs)
                return out.clone() if own_output else out
            if method.bound_session != session.id:
                # Re-point this method at the session's state only when another session ran it last.
                method.bind(self._store, session.state)
                method.bound_session = session.id
            with torch.inference_mode():
                return method(*inputs)

    # -- accounting ----------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Weights (unique, resident, duplicated), session state and device-level use of this Engine."""
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
        return MemoryReport(device=str(self.device), unique_weight_bytes=unique, resident_weight_bytes=resident,
                            duplicated_weight_bytes=resident - unique,
                            state_bytes=sum(s.state_bytes for s in self._sessions.values()),
                            sessions_open=len(self._sessions), state_bytes_per_session=self.state_bytes_per_session,
                            device_used_bytes=used - self._baseline_used, device_total_used_bytes=used,
                            capacity=self.capacity(), graph_slots=len(self._slots), free_graph_slots=len(self._free_slots),
                            graph_bytes=sum(s.overhead_bytes for s in self._slots), workspace_bytes=self.workspace.nbytes,
                            notes=notes)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Free sessions, methods and weights (device memory back to where it was). Idempotent."""
        with self._lock:
            if self.closed:
                return
            for s in list(self._sessions.values()):
                self._close_session(s)
            if self._slots:
                torch.cuda.synchronize(self.device)
            for slot in self._slots:
                slot.release()
            self._slots.clear()
            self._free_slots.clear()
            self.workspace.clear()
            self._pool = self._warmup_stream = None
            for m in self._methods.values():
                m.close()
            self._methods.clear()
            self._store.clear()
            self.closed = True
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

