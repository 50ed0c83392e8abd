"""A session: one conversation's own row of the engine's state pool, on the device.

A Session is a handle: its row (a lease on it), its position, the ids its state holds, its named
device slots, and which request or call is using it. What it runs goes through a narrow protocol,
`SessionHost` (the engine's `sessions.Sessions`): the session never reaches into the engine.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..errors import InputError, SessionClosedError
from ..params import SamplingParams
from ..tokenizer import TextStream, Tokenizer
from .rows import RowLease
from .state import SessionSnapshot
from .stream import TokenStream


@dataclass(frozen=True)
class Slot:
    """Names a tensor kept on the device in a session; pass it among a method's inputs."""

    name: str


@dataclass(frozen=True)
class Token:
    """One generated token: its id and the text it completes (may be "" mid UTF-8 sequence)."""

    id: int
    text: str


class SessionHost(Protocol):
    """What a session runs through (the engine's side). Each call checks the engine is open; device
    calls hold the engine's lock."""

    device: torch.device
    state_bytes_per_session: int

    @property
    def tokenizer(self) -> Tokenizer: ...

    def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = True) -> list[int]: ...

    def submit(self, prompt: list[int], params: SamplingParams | None, *, session: "Session",
               stop_ids: Sequence[int] | None) -> TokenStream: ...

    def run(self, session: "Session", method: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor: ...

    def prefill(self, session: "Session", ids: Sequence[int]) -> torch.Tensor: ...

    def decode(self, session: "Session", token: torch.Tensor) -> torch.Tensor: ...

    def reset(self, session: "Session") -> None: ...

    def state(self, session: "Session") -> dict[str, torch.Tensor]: ...

    def snapshot(self, session: "Session") -> SessionSnapshot: ...

    def restore(self, session: "Session", snap: SessionSnapshot) -> None: ...

    def release(self, session: "Session") -> None: ...


class Session:
    """Owns exactly one row of every state tensor. Use as a context manager or call close().

    Create with `Engine.open_session` (or get one from ``stream.session``). Generation (`generate`,
    `generate_ids`, `submit`) goes through the engine's scheduler, batched with every other session;
    the direct calls (`run`, `prefill`, `decode`) run one method for this session alone. Different
    sessions may be used from different threads at once; one session runs one request or call at a
    time. While a request runs, ``position`` and ``tokens`` are the session's before it.
    """

    def __init__(self, host: SessionHost, session_id: int, lease: RowLease) -> None:
        self._host, self.id, self.lease = host, session_id, lease
        self.position = 0  # tokens already in the state (next write position)
        self.tokens: list[int] | None = []  # the ids the state holds, when known (what the prefix cache publishes)
        self.closed = False
        self._kept: dict[str, torch.Tensor] = {}  # named device slots
        self._user: TokenStream | object | None = None  # the request (its stream) or direct call using it
        self._user_lock = threading.Lock()

    @property
    def row(self) -> int:
        return self.lease.row

    @property
    def host(self) -> SessionHost:
        """What the session runs through (its engine's sessions)."""
        return self._host

    # -- who uses it ---------------------------------------------------------------------------
    def attach(self, stream: TokenStream) -> None:
        """A request on this session: refused while another request or call uses it, or once closed."""
        with self._user_lock:
            self.check_open()
            if self._user is not None and not (isinstance(self._user, TokenStream) and self._user.done):
                raise InputError(f"session {self.id} already has a request running; wait for it to finish or "
                                 "cancel it, or open another session")
            self._user = stream

    def detach(self, stream: TokenStream) -> None:
        """The request of ``stream`` ended (or was never queued)."""
        with self._user_lock:
            if self._user is stream:
                self._user = None

    @property
    def stream(self) -> TokenStream | None:
        """The request running on this session, if any."""
        user = self._user
        return user if isinstance(user, TokenStream) and not user.done else None

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Held around a direct call: InputError if a request runs on the session."""
        marker = object()
        with self._user_lock:
            self.check_open()
            if self._user is not None and not (isinstance(self._user, TokenStream) and self._user.done):
                raise InputError(f"session {self.id} has a request running; wait for it or cancel it first")
            self._user = marker
        try:
            yield
        finally:
            with self._user_lock:
                if self._user is marker:
                    self._user = None

    def check_open(self) -> None:
        """SessionClosedError once closed."""
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed; open a new one with engine.open_session()")

    # -- running methods directly ------------------------------------------------------------
    def run(self, method: str, *inputs: "torch.Tensor | Slot", keep_as: str | None = None) -> torch.Tensor:
        """Run a method on this session's row; the output stays on the device.

        Inputs are the method's own (not the rows or the state: the session adds those). They
        may be `Slot(name)`: a tensor kept earlier with ``keep_as`` (or `keep`), used in place
        with no host round trip. Shapes, dtypes and value ranges are checked before any kernel
        runs. ``keep_as`` keeps the output under that name for later calls.
        """
        resolved = tuple(self.slot(i.name) if isinstance(i, Slot) else i for i in inputs)
        out = self._host.run(self, method, resolved)
        if keep_as is not None:
            self.keep(keep_as, out)
        return out

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        """Keep a device tensor under ``name`` until reset() or close() (replacing any earlier one)."""
        self.check_open()
        if tensor.device.type != self._host.device.type:
            raise InputError(f"slot {name!r} must hold a tensor on {self._host.device}, got {tensor.device}")
        self._kept[name] = tensor

    def slot(self, name: str) -> torch.Tensor:
        """The tensor kept under ``name``; InputError if there is none."""
        self.check_open()
        if name not in self._kept:
            have = ", ".join(sorted(self._kept)) or "none"
            raise InputError(f"session {self.id} has no slot {name!r} (slots: {have}); run the method that "
                             f"produces it with keep_as={name!r} first")
        return self._kept[name]

    @property
    def slots(self) -> dict[str, torch.Tensor]:
        return dict(self._kept)

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Feed ``ids`` after what the session already holds, in chunks; the last position's logits.

        Raises InputError for ids outside the vocabulary and PromptTooLongError if they do not fit
        in max_seq_len, both before any method runs.
        """
        return self._host.prefill(self, ids)

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one token given as a device tensor (no host round trip); returns logits [1, vocab].

        The logits may be a view of a captured graph's output: clone them to keep them past the
        engine's next decode step.
        """
        return self._host.decode(self, token)

    # -- generation (through the scheduler) --------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
               stop_ids: Sequence[int] | None = None) -> TokenStream:
        """Queue a generation on this session's state; returns its `TokenStream` at once."""
        self.check_open()
        return self._host.submit(list(prompt_ids), params, session=self, stop_ids=stop_ids)

    def generate_ids(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                     stop_ids: Sequence[int] | None = None) -> Iterator[int]:
        """Stream new token ids: prefill ``prompt_ids`` after the session's state, then sample and
        decode until a stop id (default: the model's eos), max_new_tokens or max_seq_len."""
        stream = self.submit(prompt_ids, params, stop_ids)
        try:
            yield from stream
        finally:
            stream.cancel()  # the consumer stopped early: free the work (no-op when finished)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 chat: bool = True) -> Iterator[Token]:
        """Stream tokens for a text prompt (rendered with the chat template unless ``chat=False``) or token ids."""
        ids = self._host.encode_prompt(prompt, chat=chat)
        text = TextStream(self._host.tokenizer)
        for token_id in self.generate_ids(ids, params):
            yield Token(token_id, text.push(token_id))

    # -- state ---------------------------------------------------------------------------------
    @property
    def state(self) -> dict[str, torch.Tensor]:
        """This session's state tensors by FQN: views of its row of the pool; paged KV comes as a copy
        gathered from its blocks, [H, table width x block size, D] (positions it never wrote are zero)."""
        return self._host.state(self)

    @property
    def state_bytes(self) -> int:
        """Bytes of this session's state at most (its pool row, and its KV blocks at max_seq_len)."""
        return self._host.state_bytes_per_session

    def reset(self) -> None:
        """Start a new conversation in this session (its row zeroed, position 0, slots dropped)."""
        self._host.reset(self)
        self._kept.clear()

    def snapshot(self) -> SessionSnapshot:
        """Copy this session's row of every state tensor and its position to host memory."""
        return self._host.snapshot(self)

    def save(self, path: str | Path) -> None:
        """Write a snapshot to a safetensors file; `Engine.open_session(restore=path)` resumes it."""
        self.snapshot().save(path)

    def restore(self, snap: SessionSnapshot) -> None:
        """Load a snapshot into this (idle) session's row: its state and position."""
        self._host.restore(self, snap)

    # -- lifetime ------------------------------------------------------------------------------
    def close(self, timeout: float = 60.0) -> None:
        """Cancel its running request, zero its row and give it back; later use raises SessionClosedError.

        If the request has not ended after ``timeout`` s (a step still runs on the row), the session
        is closed at once but its row goes back only when the request has ended: no other session is
        handed a row that a step may still write.
        """
        if self.closed:
            return
        stream = self.stream
        if stream is not None and not stream.cancel(timeout=timeout):
            with self._user_lock:
                if self._user is stream and not stream.done:  # the engine gives the row back when it ends
                    self.mark_closed()
                    return
        self._host.release(self)

    def mark_closed(self) -> None:
        """Refuse further use (the row goes back, or already went back, through the engine)."""
        self._kept.clear()
        self.closed = True

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
