"""Token sampling on the device: greedy, temperature, top-k, top-p, with a seed. No host sync inside."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output (CTRL-style)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class Sampler:
    """Draws the next token id from logits [1, vocab]; returns a [1] int64 tensor on the same device."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        self.params = params
        self.generator = torch.Generator(device=device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()
        self.device = device
        self.seen: torch.Tensor | None = None  # bool [vocab] on the device, for the repetition penalty
        self._pending: torch.Tensor | None = None

    def observe_prompt(self, ids: list[int]) -> None:
        """Count the prompt's tokens as seen (one host-to-device copy, before decoding starts)."""
        if self.params.repetition_penalty != 1.0:
            self._pending = torch.tensor(list(ids), dtype=torch.long, device=self.device)

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        if self.seen is None:
            self.seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            if self._pending is not None:
                self.seen[self._pending] = True
        p = self.params.repetition_penalty
        x = logits.float()
        return torch.where(self.seen, torch.where(x > 0, x / p, x * p), x)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.repetition_penalty != 1.0:
            logits = self._penalize(logits)
        token = self._pick(logits)
        if self.seen is not None:
            self.seen[token] = True  # stays on the device
        return token

    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p.greedy:
            return logits.argmax(dim=-1)
        x = logits.float() / p.temperature
        if p.top_k > 0 and p.top_k < x.shape[-1]:
            kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, idx = torch.sort(x, dim=-1, descending=True)
            sorted_p = sorted_x.softmax(dim=-1)
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) > p.top_p  # keep the smallest prefix reaching top_p
            x = x.scatter(-1, idx, sorted_x.masked_fill(drop, float("-inf")))
        probs = x.softmax(dim=-1)
        # Exponential race (gpt-fast): argmax(p / E) with E ~ Exp(1) samples from p without a host sync.
        race = torch.empty_like(probs).exponential_(1.0, generator=self.generator)
        return (probs / race).argmax(dim=-1)
