"""A session: one conversation's own state on the device, run through the engine's shared methods."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import InputError, PromptTooLongError, SessionClosedError
from ..sampling import Sampler, SamplingParams
from .state import SessionSnapshot, SessionState

if TYPE_CHECKING:
    from .engine import Engine


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
    """Owns exactly one copy of the model's mutable state. Use as a context manager or call close().

    Create with `Engine.open_session`. Different sessions may be driven from different threads at
    once (the engine serializes method calls and re-points the compiled methods when another
    session ran last); one session is driven by one thread at a time.
    """

    def __init__(self, engine: "Engine", session_id: int, state: SessionState) -> None:
        self.engine, self.id, self._state = engine, session_id, state
        self.position = 0  # tokens already in the state (next write position)
        self.closed = False
        self._slot = None  # the GraphSlot this session borrows when the engine uses CUDA graphs
        self._kept: dict[str, torch.Tensor] = {}  # named device slots (e.g. an encoder output)

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """This session's state tensors by FQN (views of one device buffer)."""
        return self._state.tensors

    @property
    def state_bytes(self) -> int:
        """Sum of this session's state tensor bytes."""
        return sum(t.numel() * t.element_size() for t in self._state.tensors.values())

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed; open a new one with engine.open_session()")

    # -- running methods -----------------------------------------------------------------------
    def run(self, method: str, *inputs: "torch.Tensor | Slot", keep_as: str | None = None) -> torch.Tensor:
        """Run a method against this session's state; the output stays on the device.

        Inputs may be `Slot(name)`: a tensor kept earlier with ``keep_as`` (or `keep`), used in
        place with no host round trip; its shape and dtype are checked against the method's inputs.
        ``keep_as`` keeps the output under that name for later calls.
        """
        self._check_open()
        resolved = tuple(self.slot(i.name) if isinstance(i, Slot) else i for i in inputs)
        out = self.engine._run(self, method, resolved)
        if keep_as is not None:
            self.keep(keep_as, out)
        return out

    def keep(self, name: str, tensor: torch.Tensor) -> None:
        """Keep a device tensor under ``name`` until reset() or close() (replacing any earlier one)."""
        self._check_open()
        if tensor.device.type != self.engine.device.type:
            raise InputError(f"slot {name!r} must hold a tensor on {self.engine.device}, got {tensor.device}")
        self._kept[name] = tensor

    def slot(self, name: str) -> torch.Tensor:
        """The tensor kept under ``name``; InputError if there is none."""
        self._check_open()
        if name not in self._kept:
            have = ", ".join(sorted(self._kept)) or "none"
            raise InputError(f"session {self.id} has no slot {name!r} (slots: {have}); run the method that "
                             f"produces it with keep_as={name!r} first")
        return self._kept[name]

    @property
    def slots(self) -> dict[str, torch.Tensor]:
        return dict(self._kept)

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Feed ``ids`` after what the session already holds; returns the last position's logits.

        Raises PromptTooLongError before any method runs if the ids do not fit in max_seq_len.
        """
        self._check_open()
        ids = list(ids)
        if not ids:
            raise InputError("prompt is empty; give at least one token")
        limit = self.engine.max_seq_len
        if self.position + len(ids) > limit:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens after {self.position} already in the session exceeds max_seq_len={limit}; "
                "shorten the prompt, reset the session, or export the bundle with a larger --max-seq-len")
        dev, bound = self.engine.device, self.engine.prefill_bound
        logits, i = None, 0
        while i < len(ids):
            n = min(bound, len(ids) - i)
            method = "prefill" if n >= 2 else "decode"
            tokens = torch.tensor([ids[i:i + n]], dtype=torch.long, device=dev)
            pos = torch.arange(self.position, self.position + n, dtype=torch.long, device=dev)
            logits = self.run(method, tokens, pos)
            self.position += n
            i += n
        assert logits is not None
        return logits

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """Feed one token given as a device tensor (no host round trip); returns logits [1, vocab].

        With CUDA graphs the logits are the slot's static output buffer, overwritten by this
        session's next decode: clone them to keep them longer.
        """
        self._check_open()
        if self.position >= self.engine.max_seq_len:
            raise PromptTooLongError(f"session {self.id} is full (max_seq_len={self.engine.max_seq_len}); reset it")
        pos = torch.full((1,), self.position, dtype=torch.long, device=self.engine.device)
        # The logits may be a graph's static output: valid until this session's next decode.
        logits = self.engine._run(self, "decode", (token.view(1, 1), pos), own_output=False)
        self.position += 1
        return logits

    # -- generation ----------------------------------------------------------------------------
    def generate_ids(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                     stop_ids: Sequence[int] | None = None) -> Iterator[int]:
        """Stream new token ids: prefill ``prompt_ids``, then sample and decode until eos or a limit."""
        params = params or SamplingParams()
        stop = set(self.engine.eos_token_ids if stop_ids is None else stop_ids)
        sampler = Sampler(params, self.engine.device)
        sampler.observe_prompt(prompt_ids)
        logits = self.prefill(prompt_ids)
        for n in range(params.max_new_tokens):
            token = sampler(logits)
            token_id = int(token.item())  # the one device-to-host copy per step
            yield token_id
            if token_id in stop or n + 1 == params.max_new_tokens or self.position >= self.engine.max_seq_len:
                return
            logits = self.decode(token)

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                 chat: bool = True) -> Iterator[Token]:
        """Stream tokens for a text prompt (rendered with the chat template unless ``chat=False``) or token ids."""
        from ..tokenizer import TextStream

        tok = self.engine.tokenizer
        if isinstance(prompt, str):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
            ids = tok.encode(text)
        else:
            ids = list(prompt)
        stream = TextStream(tok)
        for token_id in self.generate_ids(ids, params):
            yield Token(token_id, stream.push(token_id))

    # -- lifetime ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new conversation in this session (state zeroed, position 0)."""
        self._check_open()
        with self.engine._lock:
            self._state.zero_()
            self._kept.clear()
            self.position = 0

    def snapshot(self) -> SessionSnapshot:
        """Copy state and position to host memory."""
        self._check_open()
        with self.engine._lock:
            state = {k: v.detach().to("cpu", copy=True) for k, v in self.state.items()}
            return SessionSnapshot(state=state, position=self.position, fingerprint=self.engine.manifest.fingerprint())

    def save(self, path: str | Path) -> None:
        """Write a snapshot to a safetensors file; `Engine.open_session(restore=path)` resumes it."""
        self.snapshot().save(path)

    def _restore(self, snap: SessionSnapshot) -> None:
        m = self.engine.manifest
        if snap.fingerprint != m.fingerprint():
            raise InputError("the snapshot belongs to another model or export (fingerprint differs); "
                             "restore it into an Engine loaded from the same bundle")
        if set(snap.state) != set(self.state):
            raise InputError(f"the snapshot holds state {sorted(set(snap.state) ^ set(self.state))[:4]} that this "
                             "bundle does not declare; restore it into the bundle it came from")
        for k, t in self.state.items():
            src = snap.state[k]
            if src.shape != t.shape or src.dtype != t.dtype:
                raise InputError(f"snapshot state {k!r} is {src.dtype}{list(src.shape)}, expected {t.dtype}{list(t.shape)}")
        if not 0 <= snap.position <= self.engine.max_seq_len:
            raise InputError(f"snapshot position {snap.position} is outside 0..{self.engine.max_seq_len}")
        for k, t in self.state.items():
            t.copy_(snap.state[k])
        self.position = snap.position

    def close(self) -> None:
        """Free this session's state; further use raises SessionClosedError. Idempotent."""
        if not self.closed:
            self.engine._close_session(self)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
