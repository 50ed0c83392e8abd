"""The open sessions of one engine, and what a session runs on the device by itself.

`Sessions` opens sessions (a row leased from the scheduler), gives a session handle to each request
admitted on a row of its own, gives rows back (exactly once: `rows.RowLease`), and is the
`session.SessionHost` every session talks to: its direct method calls, reset, state, snapshots.
Device work goes through one fail-closed door (`_device`): the state operations queued so far are
applied first, and anything that raises there but onecopy's own typed errors fails the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..bundle import Manifest
from ..errors import EngineFailedError, InputError, OnecopyError, PromptTooLongError, SessionCapacityError
from ..params import SamplingParams
from ..tokenizer import Tokenizer
from .plan import ZeroRow
from .prompts import Prompts
from .request import Request
from .rows import RowLease
from .runner import ModelRunner
from .scheduler import Scheduler
from .session import Session
from .state import SessionSnapshot
from .stream import TokenStream
from .turn_lock import TurnLock


class Sessions:
    """Open sessions by id, and the engine's side of `session.SessionHost`. Thread-safe (the engine's lock)."""

    def __init__(self, *, runner: ModelRunner, scheduler: Scheduler, lock: TurnLock, manifest: Manifest,
                 prompts: Prompts, state_bytes_per_session: int, check_open: Callable[[], None],
                 usable: Callable[[], bool],
                 fail: Callable[[BaseException], EngineFailedError], submit: Callable[..., TokenStream],
                 wake: Callable[[], None], capacity_error: Callable[[], SessionCapacityError],
                 on_open: Callable[[], None] = lambda: None) -> None:
        self.runner, self.scheduler, self.lock, self.manifest, self.prompts = runner, scheduler, lock, manifest, prompts
        self.device = runner.device
        self.state_bytes_per_session = state_bytes_per_session
        self._check_open, self._usable = check_open, usable
        self._fail, self._submit, self._wake = fail, submit, wake
        self._capacity_error, self._on_open = capacity_error, on_open
        self._open: dict[int, Session] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._open)

    # -- lifecycle ------------------------------------------------------------------------------
    def open(self, restore: SessionSnapshot | None = None) -> Session:
        """A session on a free row (zeroed); SessionCapacityError when none is free."""
        with self.lock:
            self._check_open()
            if self.scheduler.rows.free_rows == 0:
                raise self._capacity_error()
            session = self._register(self.scheduler.take_row())
            if restore is not None:
                try:
                    self.restore(session, restore)
                except BaseException:
                    self.release(session)
                    raise
            return session

    def adopt(self, req: Request) -> Session:
        """The handle of a request admitted on a row of its own (``stream.session``)."""
        session = self._register(req.lease)
        session.attach(req.stream)
        req.stream.session = session
        return session

    def _register(self, lease: RowLease) -> Session:
        session = Session(self, self._next_id, lease)
        self._next_id += 1
        self._open[session.id] = session
        self._on_open()
        return session

    def release(self, session: Session) -> None:
        """Close ``session`` and give its row back (zeroed before anyone runs on it). Idempotent: the row
        goes back once, whichever path gets here first. While a request still runs on the session, the
        row goes back when that request ends (`finished`), never from under it."""
        with self.lock:
            session.mark_closed()
            if session.stream is not None:
                return
            self._open.pop(session.id, None)
            freed = self.scheduler.free_row(session.lease)
            if freed and self._usable():
                self._device(lambda: None)  # zeroed now: nothing of the session stays on the device
        if freed:
            self._wake()  # a waiting request may take the row

    def finished(self, req: Request) -> None:
        """A request ended (the loop, under the lock): its session takes what its row now holds, or is
        closed with it (a row of its own, not kept: the scheduler gave the row back)."""
        session: Session | None = req.stream.session
        if session is None:
            return
        session.detach(req.stream)
        if req.owns_row and not self.scheduler.kept(req):
            session.mark_closed()
            self._open.pop(session.id, None)
            return
        if req.admitted:
            session.position, session.tokens = req.end, req.held
        if session.closed:  # closed while the request ran: its row goes back now
            self.release(session)

    def close_all(self) -> None:
        """The engine is closing: every session refuses further use."""
        for s in list(self._open.values()):
            s.mark_closed()
        self._open.clear()

    # -- the device, fail closed ----------------------------------------------------------------------
    def _device(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` (device work, under the lock) after the queued state operations. onecopy's typed
        errors pass through; anything else fails the engine (the device's state is unknown)."""
        try:
            self.runner.apply(self.scheduler.ops.take())
            return fn()
        except OnecopyError:
            raise
        except Exception as e:
            raise self._fail(e) from e

    def _prepare(self, session: Session, start: int, upto: int) -> None:
        """Paged KV: positions [start, upto) of the session's row made its own; SessionCapacityError first."""
        if self.scheduler.kv is not None:
            self.scheduler.kv.prepare(session.row, start, upto)

    # -- session.SessionHost ---------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self.prompts.tokenizer

    def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = True) -> list[int]:
        return self.prompts.encode(prompt, chat=chat)

    def submit(self, prompt: list[int], params: SamplingParams | None, *, session: Session,
               stop_ids: Sequence[int] | None) -> TokenStream:
        return self._submit(prompt, params, session=session, stop_ids=stop_ids)

    def run(self, session: Session, method: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with self.lock, session.in_use():
            self._check_open()
            inputs = self.runner.checked_inputs(method, inputs)
            written = self.runner.written_positions(method, inputs)
            if written is not None:
                self._prepare(session, *written)
            out = self._device(lambda: self.runner.run(session.row, method, inputs))
            session.tokens = None  # written by a method whose inputs the session does not read
        return out

    def prefill(self, session: Session, ids: Sequence[int]) -> torch.Tensor:
        ids = self.prompts.check_token_ids(ids)
        with self.lock, session.in_use():
            self._check_open()
            start = session.position
            self.prompts.check_fits(ids, start)  # under the lock: the position is final here
            self._prepare(session, start, start + len(ids))
            if session.tokens is not None:
                session.tokens = session.tokens[:start] + ids
            chunk = self.scheduler.prefill_chunk if self.scheduler.has_prefill else 1

            def feed() -> torch.Tensor:
                logits = None
                for i in range(0, len(ids), chunk):
                    part = ids[i:i + chunk]
                    if self.scheduler.has_prefill:
                        logits = self.runner.prefill(session.row, session.position, part)
                    else:
                        logits = self.runner.decode([session.row], [session.position],
                                                    torch.tensor(part, device=self.device))
                    session.position += len(part)
                return logits

            return self._device(feed)

    def decode(self, session: Session, token: torch.Tensor) -> torch.Tensor:
        with self.lock, session.in_use():
            self._check_open()
            if session.position >= self.prompts.max_seq_len:
                raise PromptTooLongError(f"session {session.id} is full (max_seq_len={self.prompts.max_seq_len}); "
                                         "reset it")
            self._prepare(session, session.position, session.position + 1)
            session.tokens = None  # its id stays on the device: the held ids are unknown from here
            logits = self._device(lambda: self.runner.decode([session.row], [session.position], token.reshape(1)))
            session.position += 1
        return logits

    def reset(self, session: Session) -> None:
        with self.lock, session.in_use():
            self._check_open()
            if self.scheduler.kv is not None:
                self.scheduler.kv.release(session.row)
            self.scheduler.ops.add(ZeroRow(session.row))
            self._device(lambda: None)
            session.position, session.tokens = 0, []
        self._wake()  # its blocks went back: a request waiting for blocks may go on

    def state(self, session: Session) -> dict[str, torch.Tensor]:
        with self.lock:
            session.check_open()
            self._check_open()
            return self._device(lambda: self._gather(session))

    def _gather(self, session: Session) -> dict[str, torch.Tensor]:
        state = self.runner.pool.row(session.row)
        if self.runner.blocks is not None:
            state.update(self.runner.blocks.gather(self.scheduler.kv.owned[session.row]))
        return {k: state[k] for k in self.manifest.state}

    def snapshot(self, session: Session) -> SessionSnapshot:
        with self.lock, session.in_use():
            self._check_open()
            state = self._device(lambda: {k: v.detach().to("cpu", copy=True) for k, v in self._gather(session).items()})
            return SessionSnapshot(state=state, position=session.position, fingerprint=self.manifest.fingerprint())

    def restore(self, session: Session, snap: SessionSnapshot) -> None:
        with self.lock, session.in_use():
            self._check_open()
            self._check_snapshot(snap)
            kv = self.scheduler.kv
            if kv is not None:
                kv.release(session.row)
                kv.prepare(session.row, 0, snap.position)

            def write() -> None:
                if kv is not None:
                    self.runner.blocks.write(kv.owned[session.row], {k: snap.state[k] for k in self.runner.blocks.tensors})
                for k, t in self.runner.pool.row(session.row).items():
                    t.copy_(snap.state[k])

            self._device(write)
            session.position, session.tokens = snap.position, None
        self._wake()  # the blocks it held went back first: a request waiting for blocks may go on

    def _check_snapshot(self, snap: SessionSnapshot) -> None:
        """InputError unless ``snap`` is a state of this bundle, whole and in range."""
        m = self.manifest
        if snap.fingerprint != m.fingerprint():
            raise InputError("the snapshot belongs to another model or export (fingerprint differs); "
                             "restore it into an Engine loaded from the same bundle")
        if set(snap.state) != set(m.state):
            raise InputError(f"the snapshot holds state {sorted(set(snap.state) ^ set(m.state))[:4]} that this "
                             "bundle does not declare; restore it into the bundle it came from")
        blocks = self.runner.blocks
        for k, spec in m.state.items():
            shape = blocks.logical_shape(spec) if spec.paged else spec.shape
            src = snap.state[k]
            want = self.runner.pool.tensors[k].dtype if not spec.paged else blocks.tensors[k].dtype
            if list(src.shape) != list(shape) or src.dtype != want:
                raise InputError(f"snapshot state {k!r} is {src.dtype}{list(src.shape)}, expected {want}{list(shape)}")
        if not 0 <= snap.position <= m.max_seq_len:
            raise InputError(f"snapshot position {snap.position} is outside 0..{m.max_seq_len}")
