"""A session: one conversation's own row of the engine's state pool, on the device."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import InputError, PromptTooLongError, SessionClosedError
from ..sampling import SamplingParams
from .state import SessionSnapshot

if TYPE_CHECKING:
    from .engine import Engine
    from .loop import TokenStream


@dataclass(frozen=True)
class Slot:
    """Names a tensor kept on the device in a session; pass it among a method's inputs."""

    name: str


@dataclass(frozen=True)
class Token:
    """One generated token: its id and the text it completes (may be "" mid UTF-8 sequence)."""

    id: int
    text: str


class Session:
    """Owns exactly one row of every state tensor. Use as a context manager or call close().

    Create with `Engine.open_session`. Generation (`generate`, `generate_ids`, `submit`) goes
    through the engine's scheduler, batched with every other session; the direct calls (`run`,
    `prefill`, `decode`) run one method for this session alone. Different sessions may be used
    from different threads at once; one session runs one request at a time.
    """

    def __init__(self, engine: "Engine", session_id: int, row: int) -> None:
        self.engine, self.id, self.row = engine, session_id, row
        self.position = 0  # tokens already in the state (next write position)
        self.tokens: list[int] | None = []  # the ids the state holds, when known (what the prefix cache publishes)
        self.closed = False
        self.close_pending = False  # closed while a request still ran: the row goes back when it ends
        self._kept: dict[str, torch.Tensor] = {}  # named device slots
        self._stream: "TokenStream | None" = None  # the request running on this session, if any (set by the loop)
        self.attach_lock = threading.Lock()  # orders detaching a finished request against close_pending

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """This session's state tensors by FQN: views of its row of the pool; paged KV comes as a copy
        gathered from its blocks, [H, table width x block size, D] (positions it never wrote are zero)."""
        self.check_open()
        runner = self.engine.runner
        state = runner.pool.row(self.row)
        if runner.blocks is not None:
            state.update(runner.blocks.gather(self.row))
        return {k: state[k] for k in self.engine.manifest.state}

    def _writes(self, upto: int) -> None:
        """Paged KV: make positions [position, upto) this session's own to write (blocks taken, shared
        ones copied); SessionCapacityError before anything runs when the cache is full."""
        blocks = self.engine.runner.blocks
        if blocks is not None:
            blocks.prepare(self.row, self.position, upto)

    @property
    def state_bytes(self) -> int:
        """Bytes of this session's state (one pool row)."""
        return self.engine.state_bytes_per_session

    def check_open(self) -> None:
        """SessionClosedError once closed."""
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed; open a new one with engine.open_session()")

    def _check_idle(self) -> None:
        """Call under the engine's lock: no request can then start on this session until it is released."""
        self.check_open()
        self.engine.check_open()
        if self._stream is not None and not self._stream.done:
            raise InputError(f"session {self.id} has a request running; wait for it or cancel it first")

    # -- running methods directly ------------------------------------------------------------
    def run(self, method: str, *inputs: "torch.Tensor | Slot", keep_as: str | None = None) -> torch.Tensor:
        """Run a method on this session's row; the output stays on the device.

        Inputs are the method's own (not the rows or the state: the session adds those). They
        may be `Slot(name)`: a tensor kept earlier with ``keep_as`` (or `keep`), used in place
        with no host round trip. Shapes, dtypes and value ranges are checked before any kernel
        runs. ``keep_as`` keeps the output under that name for later calls.
        """
        with self.engine.lock:
            self._check_idle()
            resolved = tuple(self.slot(i.name) if isinstance(i, Slot) else i for i in inputs)
            out = self.engine.runner.run(self.row, method, resolved)
            self.tokens = None  # written by a method whose inputs this session does not read
        if keep_as is not None:
            self.keep(keep_as, out)
        return out

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        """Keep a device tensor under ``name`` until reset() or close() (replacing any earlier one)."""
        self.check_open()
        if tensor.device.type != self.engine.device.type:
            raise InputError(f"slot {name!r} must hold a tensor on {self.engine.device}, got {tensor.device}")
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
        ids = self.engine.check_token_ids(ids)
        logits = None
        runner = self.engine.runner
        with self.engine.lock:
            self._check_idle()
            self.engine.check_prompt_fits(ids, self.position)  # under the lock: the position is final here
            self._writes(self.position + len(ids))
            if self.tokens is not None:
                self.tokens = self.tokens[:self.position] + ids
            if self.engine.has_prefill:
                chunk = self.engine.scheduler.prefill_chunk
                for i in range(0, len(ids), chunk):
                    logits = runner.prefill(self.row, self.position, ids[i:i + chunk])
                    self.position += len(ids[i:i + chunk])
            else:
                for t in ids:
                    logits = runner.decode([self.row], [self.position], torch.tensor([t], device=self.engine.device))
                    self.position += 1
        assert logits is not None
        return logits

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one token given as a device tensor (no host round trip); returns logits [1, vocab].

        The logits may be a view of a captured graph's output: clone them to keep them past the
        engine's next decode step.
        """
        with self.engine.lock:
            self._check_idle()
            if self.position >= self.engine.max_seq_len:
                raise PromptTooLongError(f"session {self.id} is full (max_seq_len={self.engine.max_seq_len}); reset it")
            self._writes(self.position + 1)
            self.tokens = None  # its id stays on the device: the held ids are unknown from here
            logits = self.engine.runner.decode([self.row], [self.position], token.reshape(1))
            self.position += 1
        return logits

    # -- generation (through the scheduler) --------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
               stop_ids: Sequence[int] | None = None) -> "TokenStream":
        """Queue a generation on this session's state; returns its `TokenStream` at once."""
        self.check_open()
        return self.engine.submit(list(prompt_ids), params, session=self, stop_ids=stop_ids)

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
        from ..tokenizer import TextStream

        ids = self.engine.encode_prompt(prompt, chat=chat)
        stream = TextStream(self.engine.tokenizer)
        for token_id in self.generate_ids(ids, params):
            yield Token(token_id, stream.push(token_id))

    # -- lifetime ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new conversation in this session (its row zeroed, position 0)."""
        with self.engine.lock:
            self._check_idle()
            self.engine.runner.pool.zero_row(self.row)
            if self.engine.runner.blocks is not None:
                self.engine.runner.blocks.release(self.row)
            self._kept.clear()
            self.position, self.tokens = 0, []

    def snapshot(self) -> SessionSnapshot:
        """Copy this session's row of every state tensor and its position to host memory."""
        with self.engine.lock:
            self._check_idle()
            state = {k: v.detach().to("cpu", copy=True) for k, v in self.state.items()}
            return SessionSnapshot(state=state, position=self.position, fingerprint=self.engine.manifest.fingerprint())

    def save(self, path: str | Path) -> None:
        """Write a snapshot to a safetensors file; `Engine.open_session(restore=path)` resumes it."""
        self.snapshot().save(path)

    def restore(self, snap: SessionSnapshot) -> None:
        """Load a snapshot into this (idle) session's row: its state and position."""
        m = self.engine.manifest
        if snap.fingerprint != m.fingerprint():
            raise InputError("the snapshot belongs to another model or export (fingerprint differs); "
                             "restore it into an Engine loaded from the same bundle")
        state = self.state
        if set(snap.state) != set(state):
            raise InputError(f"the snapshot holds state {sorted(set(snap.state) ^ set(state))[:4]} that this "
                             "bundle does not declare; restore it into the bundle it came from")
        for k, t in state.items():
            src = snap.state[k]
            if src.shape != t.shape or src.dtype != t.dtype:
                raise InputError(f"snapshot state {k!r} is {src.dtype}{list(src.shape)}, expected {t.dtype}{list(t.shape)}")
        if not 0 <= snap.position <= self.engine.max_seq_len:
            raise InputError(f"snapshot position {snap.position} is outside 0..{self.engine.max_seq_len}")
        blocks = self.engine.runner.blocks
        if blocks is not None:
            blocks.release(self.row)
            blocks.scatter(self.row, {k: snap.state[k] for k in blocks.tensors}, snap.position)
        rows = self.engine.runner.pool.row(self.row)
        for k, t in rows.items():
            t.copy_(snap.state[k])
        self.position, self.tokens = snap.position, None

    def close(self, timeout: float = 60.0) -> None:
        """Cancel its running request, zero its row and give it back; later use raises SessionClosedError.

        If the request has not ended after ``timeout`` s (a step still runs on the row), the session
        is closed at once but its row goes back only when the request has ended: no other session is
        handed a row that a step may still write.
        """
        if self.closed:
            return
        stream = self._stream
        if stream is not None and not stream.cancel(timeout=timeout):
            with self.attach_lock:  # not the engine's lock: the hung step holds it
                if self._stream is stream:  # still attached: the loop releases the row when it ends
                    self.close_pending = True
                    self.mark_closed()
                    return
        self.engine.release_session(self)

    def mark_closed(self) -> None:
        """Refuse further use (the engine gives the row back)."""
        self._kept.clear()
        self.closed = True

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
