"""A session: one conversation's own state tensors on the device, run through the shared methods."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ..errors import InputError, PromptTooLongError, SessionClosedError
from ..sampling import Sampler, SamplingParams

if TYPE_CHECKING:
    from .engine import Engine


class Session:
    """Owns exactly one copy of the model's mutable state. Use as a context manager or call close()."""

    def __init__(self, engine: "Engine", session_id: int, state: dict[str, torch.Tensor]) -> None:
        self.engine, self.id, self.state = engine, session_id, state
        self.position = 0  # tokens already in the state (next write position)
        self.closed = False

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed; open a new one with engine.open_session()")

    def run(self, method: str, *inputs: torch.Tensor) -> torch.Tensor:
        """Run a method against this session's state; the output stays on the device."""
        self._check_open()
        return self.engine._run(self, method, inputs)

    def reset(self) -> None:
        """Start a new conversation in this session (state zeroed, position 0)."""
        self._check_open()
        with self.engine._lock:
            for t in self.state.values():
                t.zero_()
            self.position = 0

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Feed ``ids`` after what the session already holds; returns the last position's logits."""
        self._check_open()
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
        """Feed one token given as a device tensor (no host round trip); returns logits [1, vocab]."""
        self._check_open()
        if self.position >= self.engine.max_seq_len:
            raise PromptTooLongError(f"session {self.id} is full (max_seq_len={self.engine.max_seq_len}); reset it")
        pos = torch.full((1,), self.position, dtype=torch.long, device=self.engine.device)
        logits = self.run("decode", token.view(1, 1), pos)
        self.position += 1
        return logits

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams | None = None,
                     stop_ids: list[int] | None = None) -> Iterator[int]:
        """Stream new token ids: prefill ``prompt_ids``, then sample and decode until eos or a limit."""
        params = params or SamplingParams()
        stop = set(self.engine.eos_token_ids if stop_ids is None else stop_ids)
        sampler = Sampler(params, self.engine.device)
        logits = self.prefill(prompt_ids)
        for n in range(params.max_new_tokens):
            token = sampler(logits)
            token_id = int(token.item())  # the one device-to-host copy per step
            yield token_id
            if token_id in stop or n + 1 == params.max_new_tokens or self.position >= self.engine.max_seq_len:
                return
            logits = self.decode(token)

    def generate(self, prompt: str, params: SamplingParams | None = None, *, chat: bool = True) -> Iterator[str]:
        """Stream text for ``prompt`` (rendered with the chat template unless ``chat=False``)."""
        from ..tokenizer import TextStream

        tok = self.engine.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        stream = TextStream(tok)
        for token_id in self.generate_ids(tok.encode(text), params):
            piece = stream.push(token_id)
            if piece:
                yield piece

    def close(self) -> None:
        """Free this session's state; further use raises SessionClosedError."""
        if not self.closed:
            self.engine._close_session(self)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
