"""How to pick tokens: a request's sampling parameters, checked on construction (no torch here: the
scheduler reads them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .errors import InputError
from .grammar import Grammar


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None  # None: a random seed per request
    max_new_tokens: int = 256
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output (CTRL-style)
    suppress_ids: tuple[int, ...] = field(default=())  # never generated
    begin_suppress_ids: tuple[int, ...] = field(default=())  # not generated as the first token
    grammar: Grammar | None = None  # the output must match it (`grammar`: JSON schema, JSON object, regex, Lark)

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
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InputError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def draw_seed(self) -> int:
        """A request's seed: ``seed``, else a random one (drawn once per request and kept through its
        preemptions: the draws are a function of the seed and the position, so they repeat)."""
        return self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
