"""Prompt checks and encoding for one bundle: token ids inside the vocabulary, prompts inside max_seq_len,
text through the tokenizer and chat template. All on the host, before anything runs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..bundle import Manifest
from ..errors import InputError, PromptTooLongError
from ..tokenizer import Tokenizer


class Prompts:
    """The bundle's vocabulary, context length and tokenizer (loaded on first use)."""

    def __init__(self, manifest: Manifest, path: Path) -> None:
        self.manifest, self.path = manifest, path
        self.vocab_size = int(manifest.config["vocab_size"])
        self.max_seq_len = manifest.max_seq_len
        self._tokenizer: Tokenizer | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            t, m = self.manifest.tokenizer, self.manifest
            self._tokenizer = Tokenizer.from_file(self.path / t["file"], m.generation.get("chat_template"),
                                                  t.get("bos_token_id"))
        return self._tokenizer

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

    def check_fits(self, ids: Sequence[int], start: int) -> None:
        """InputError for an empty prompt, PromptTooLongError if ``ids`` after ``start`` tokens pass max_seq_len."""
        if not ids:
            raise InputError("prompt is empty; give at least one token")
        if start + len(ids) > self.max_seq_len:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens after {start} already in the session exceeds max_seq_len={self.max_seq_len}; "
                "shorten the prompt, reset the session, or export the bundle with a larger --max-seq-len")

    def encode(self, prompt: str | Sequence[int], *, chat: bool = True) -> list[int]:
        """Token ids of a text prompt (through the chat template unless ``chat=False``) or of given ids."""
        if isinstance(prompt, str):
            tok = self.tokenizer
            text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
            return tok.encode(text)
        return self.check_token_ids(prompt)
