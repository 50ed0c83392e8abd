"""The Engine: one bundle loaded on one device, its weights held once, serving sessions."""

from __future__ import annotations

import threading
from collections.abc import Iterable
import warnings
from pathlib import Path

import torch

from ..bundle import Manifest, parse_dtype, read_bundle
from ..errors import EngineClosedError, InputError, SessionCapacityError
from ..tokenizer import Tokenizer
from .memory import MemoryReport, device_used
from .method import Method
from .session import Session
from .weights import WeightStore


def _release(tensors: "Iterable[torch.Tensor]") -> None:
    """Free the memory of tensors we own even though AOTI runners still reference them.

    Measured (torch 2.13): a runner given user-managed constants keeps references to them even
    after the runner is deleted, so dropping our own references frees nothing. Shrinking the
    storage to zero bytes returns the memory; no runner reads it again (they are rebound first).
    """
    for t in tensors:
        t.untyped_storage().resize_(0)


class Engine:
    """Owns the weight store, the loaded methods and the open sessions. Create with `Engine.load`."""

    def __init__(self, path: Path, manifest: Manifest, device: torch.device, methods: dict[str, Method],
                 store: WeightStore, baseline_used: int, max_sessions: int | None) -> None:
        self.path, self.manifest, self.device = path, manifest, device
        self._methods, self._store = methods, store
        self._baseline_used = baseline_used
        self._sessions: dict[int, Session] = {}
        self._next_id = 0
        self._bound: Session | None = None  # the session whose state the methods point at
        self._lock = threading.RLock()
        self._tokenizer: Tokenizer | None = None
        self.max_sessions = max_sessions
        self.closed = False

    @classmethod
    def load(cls, bundle_dir: str | Path, device: str | torch.device = "cpu", *,
             max_sessions: int | None = None) -> "Engine":
        """Validate the whole bundle, then load each method and each needed weight once.

        Raises a BundleError subclass (and holds nothing) if any check fails.
        """
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise InputError("device='cuda' asked for but no CUDA GPU is visible; load with device='cpu'")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.init()
        baseline = device_used(dev)
        bundle = read_bundle(Path(bundle_dir), dev.type)
        methods: dict[str, Method] = {}
        store = WeightStore(dev)
        try:
            for name, spec in bundle.manifest.methods.items():
                methods[name] = Method(spec, bundle.package_path(name), dev)
            needed = {f for m in methods.values() if not m.embeds_weights for f in m.weight_fqns}
            store.load(bundle, needed)
        except BaseException:
            for m in methods.values():
                m.close()
            store.clear()
            raise
        finally:
            bundle.close()
        engine = cls(Path(bundle_dir), bundle.manifest, dev, methods, store, baseline, max_sessions)
        if any(m.embeds_weights for m in methods.values()):
            warnings.warn(f"bundle {bundle_dir} has methods that carry their own weights "
                          f"({engine.memory_report().duplicated_weight_bytes} duplicated bytes); "
                          "export it again with onecopy to share one copy", stacklevel=2)
        return engine

    # -- introspection -------------------------------------------------------------------------
    @property
    def methods(self) -> list[str]:
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
        return sum(s.nbytes for s in self.manifest.state.values())

    # -- sessions ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise EngineClosedError("this Engine is closed; load the bundle again with Engine.load")

    def open_session(self) -> Session:
        """Allocate a session's state now (so an out-of-memory error surfaces here, not mid-request)."""
        with self._lock:
            self._check_open()
            if self.max_sessions is not None and len(self._sessions) >= self.max_sessions:
                raise SessionCapacityError(
                    f"{len(self._sessions)} sessions are open (max_sessions={self.max_sessions}); one more needs "
                    f"{self.state_bytes_per_session} bytes of state. Close a session or load with a larger max_sessions")
            state = {k: torch.zeros(s.shape, dtype=parse_dtype(s.dtype), device=self.device)
                     for k, s in self.manifest.state.items()}
            session = Session(self, self._next_id, state)
            self._sessions[session.id] = session
            self._next_id += 1
            return session

    def _close_session(self, session: Session) -> None:
        with self._lock:
            session.closed = True
            self._sessions.pop(session.id, None)
            if self._bound is session:
                self._bound = None  # runners keep stale pointers; the next run rebinds before use
            _release(session.state.values())
            session.state = {}

    @property
    def sessions_open(self) -> int:
        return len(self._sessions)

    def _run(self, session: Session, name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        method = self.method(name)
        method.check_inputs(inputs)
        with self._lock:
            self._check_open()
            if self._bound is not session:
                # Re-point every method at this session's state only when the session changes.
                for m in self._methods.values():
                    m.bind(self._store.as_map(m.weight_fqns) if not m.embeds_weights else {}, session.state)
                self._bound = session
            with torch.inference_mode():
                return method(*inputs)

    # -- accounting ----------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Weights (unique, resident, duplicated), state and device-level use of this Engine."""
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
        state = sum(s.state_bytes for s in self._sessions.values())
        used = device_used(self.device)
        return MemoryReport(device=str(self.device), unique_weight_bytes=unique, resident_weight_bytes=resident,
                            duplicated_weight_bytes=resident - unique, state_bytes=state,
                            sessions_open=len(self._sessions), state_bytes_per_session=self.state_bytes_per_session,
                            device_used_bytes=used - self._baseline_used, device_total_used_bytes=used, notes=notes)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Free sessions, methods and weights. Idempotent."""
        with self._lock:
            if self.closed:
                return
            for s in list(self._sessions.values()):
                self._close_session(s)
            for m in self._methods.values():
                m.close()
            self._methods.clear()
            _release(self._store.tensors())
            self._store.clear()
            self._bound = None
            self.closed = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
