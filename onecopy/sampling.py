"""Token sampling on the device, for a batch of sessions in one call, each with its own parameters.

Per row: temperature (0 = greedy), top-k, top-p, repetition penalty, suppressed ids, a seed and a grammar
(`grammar`: the tokens it allows, as a bitmask made on the host, mask every other logit first).
Randomness is counter-based: a row's uniform draw is a hash of (seed, position), computed on the
device, so a session's tokens depend only on its own seed and logits, never on which other
sessions share the step or on any generator state. Only the chosen ids leave the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .grammar import GrammarCompiler, GrammarError, Matcher
from .params import SamplingParams

# splitmix64 constants as signed int64 (torch has no full uint64 arithmetic); products wrap mod 2**64.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def counter_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """A uniform float in (0, 1) per element, a pure function of (seed, counter): splitmix64."""
    z = seed * _GOLDEN + counter + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return (_shr(z, 40).float() + 0.5) * (1.0 / (1 << 24))


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to ``device`` without blocking the host (pinned staging on CUDA)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class DrawPlan:
    """One step's draw: the rows' parameters on the host and packed on the device."""

    params: list[SamplingParams]
    first: list[bool]
    ints: torch.Tensor  # int64 [6, n]: pool rows, top-k index, seed, counter, first, greedy
    # float32 [3, n]: repetition penalty, temperature (1 for greedy rows), top-p (inf: off); None when
    # every row is greedy without a penalty (nothing reads them: no copy on the per-token path)
    floats: torch.Tensor | None
    constrained: list[int] = field(default_factory=list)  # positions of the rows with a grammar
    matchers: list[Matcher] = field(default_factory=list)  # their grammars' matchers
    # int32 [len(constrained), words]: their allowed tokens' bitmasks, and those positions, on the device
    mask_bits: torch.Tensor | None = None
    mask_index: torch.Tensor | None = None


@dataclass
class _Row:
    params: SamplingParams
    seed: int


class BatchSampler:
    """Sampling state for every pool row (parameters, seen and suppressed ids) and one draw per step."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        self.rows, self.vocab, self.device = rows, vocab_size, device
        self._row: dict[int, _Row] = {}
        self._seen: torch.Tensor | None = None  # bool [rows, vocab], allocated at the first penalty
        self._suppress: torch.Tensor | None = None  # bool [rows, vocab]: never
        self._begin: torch.Tensor | None = None  # bool [rows, vocab]: not first
        self.grammars: GrammarCompiler | None = None  # the engine's, for requests with a grammar
        self._matchers: dict[int, Matcher] = {}  # row -> its request's place in its grammar
        self._bit_of: tuple[torch.Tensor, torch.Tensor] | None = None  # each token's bitmask word and bit

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in (self._seen, self._suppress, self._begin) if t is not None)

    def _table(self, name: str) -> torch.Tensor:
        t = getattr(self, name)
        if t is None:
            t = torch.zeros(self.rows, self.vocab, dtype=torch.bool, device=self.device)
            setattr(self, name, t)
        return t

    def admit(self, row: int, params: SamplingParams, prompt_ids: list[int], seed: int | None = None,
              emitted: list[int] | None = None) -> None:
        """Start a request on ``row``: its parameters, its seed (default: `SamplingParams.draw_seed`), the
        prompt as seen (for the penalty), and its grammar's matcher, advanced over ``emitted`` (the ids a
        resumed request generated before)."""
        self._row[row] = _Row(params, params.draw_seed() if seed is None else seed)
        self._matchers.pop(row, None)
        if params.grammar is not None:
            if self.grammars is None:
                raise GrammarError("this engine cannot constrain outputs (no grammar compiler)")
            self._matchers[row] = self.grammars.matcher(params.grammar, emitted or ())
        for name, ids in (("_seen", prompt_ids if params.repetition_penalty != 1.0 else ()),
                          ("_suppress", params.suppress_ids), ("_begin", params.begin_suppress_ids)):
            if ids or getattr(self, name) is not None:
                table = self._table(name)
                table[row].zero_()
                valid = [i for i in ids if 0 <= i < self.vocab]
                if valid:
                    table[row, torch.tensor(valid, dtype=torch.long, device=self.device)] = True

    def plan(self, rows: list[int], counters: list[int], first: list[bool]) -> "DrawPlan":
        """The per-row parameters of one draw, moved to the device in one or two small copies.

        Call it before launching the step whose logits it samples: the copies then overlap with
        the step instead of waiting for it. ``counters`` (the position each id will take) key the
        random draw; ``first`` marks rows drawing their first token.
        """
        params = [self._row[r].params for r in rows]
        vocab = self.vocab
        ints = [rows, [min(p.top_k, vocab) - 1 if p.top_k > 0 else vocab - 1 for p in params],
                [self._row[r].seed for r in rows], counters, [int(f) for f in first], [int(p.greedy) for p in params]]
        floats = None
        if not all(p.greedy and p.repetition_penalty == 1.0 for p in params):
            floats = to_device(torch.tensor([[p.repetition_penalty for p in params],
                                             [p.temperature if not p.greedy else 1.0 for p in params],
                                             [p.top_p if p.top_p < 1.0 else float("inf") for p in params]],
                                            dtype=torch.float32), self.device)
        draw = DrawPlan(params, first, to_device(torch.tensor(ints, dtype=torch.long), self.device), floats)
        draw.constrained = [i for i, r in enumerate(rows) if r in self._matchers]
        draw.matchers = [self._matchers[rows[i]] for i in draw.constrained]
        return draw

    def fill_masks(self, plan: "DrawPlan") -> None:
        """The grammars' allowed tokens for ``plan``'s constrained rows, after the ids each row has emitted, made
        on the host and copied to the device. Call it after launching the step whose logits they mask: the host
        work then overlaps the forward pass."""
        if not plan.constrained or plan.mask_bits is not None:
            return
        bits = np.zeros((len(plan.constrained), (self.vocab + 31) // 32), dtype=np.int32)
        for j, m in enumerate(plan.matchers):
            m.fill(bits[j])
        plan.mask_bits = to_device(torch.from_numpy(bits), self.device)
        plan.mask_index = to_device(torch.tensor(plan.constrained, dtype=torch.long), self.device)

    def advance(self, plan: "DrawPlan", ids: list[int]) -> None:
        """Hand the ids ``plan``'s draw produced (on the host) to the grammars of its constrained rows."""
        for i, m in zip(plan.constrained, plan.matchers):
            m.advance(ids[i])

    def _allowed(self, plan: "DrawPlan", vocab: int) -> torch.Tensor:
        """bool [len(plan.constrained), vocab] from the plan's bitmasks (bit t % 32 of word t // 32)."""
        if self._bit_of is None or self._bit_of[0].numel() != vocab:
            t = torch.arange(vocab, device=self.device)
            self._bit_of = (t >> 5, (t & 31).int())
        word, bit = self._bit_of
        return ((plan.mask_bits[:, word] >> bit) & 1).bool()

    def sample(self, logits: torch.Tensor, plan: "DrawPlan") -> torch.Tensor:
        """Draw one id per row of ``logits`` [n, vocab] (row i belongs to pool row ``plan.rows[i]``).

        Returns int64 [n] on the device; no host sync.
        """
        params = plan.params
        rows_t = plan.ints[0]
        x = logits.float()
        if plan.constrained:  # a grammar's disallowed tokens first: nothing below can bring them back
            self.fill_masks(plan)
            idx = plan.mask_index
            x = x.index_copy(0, idx, x.index_select(0, idx).masked_fill(~self._allowed(plan, x.shape[-1]), float("-inf")))
        if any(p.repetition_penalty != 1.0 for p in params):
            pen = plan.floats[0][:, None]
            x = torch.where(self._seen[rows_t], torch.where(x > 0, x / pen, x * pen), x)
        if self._suppress is not None and any(p.suppress_ids for p in params):
            x = x.masked_fill(self._suppress[rows_t], float("-inf"))
        if self._begin is not None and any(f and p.begin_suppress_ids for p, f in zip(params, plan.first)):
            x = x.masked_fill(self._begin[rows_t] & plan.ints[4, :, None].bool(), float("-inf"))
        token = x.argmax(dim=-1)
        if not all(p.greedy for p in params):
            token = torch.where(plan.ints[5].bool(), token, self._draw(x, plan))
        if self._seen is not None:
            self._seen[rows_t, token] = True  # stays on the device
        return token

    def _draw(self, x: torch.Tensor, plan: "DrawPlan") -> torch.Tensor:
        params, vocab = plan.params, x.shape[-1]
        y = x / plan.floats[1][:, None]
        if any(0 < p.top_k < vocab for p in params) or any(p.top_p < 1.0 for p in params):
            sorted_y, idx = torch.sort(y, dim=-1, descending=True)
            sorted_y = sorted_y.masked_fill(sorted_y < sorted_y.gather(1, plan.ints[1][:, None]), float("-inf"))
            # top-p: keep the smallest prefix reaching top_p (rows with top_p = 1 have +inf: keep everything)
            sorted_p = sorted_y.softmax(dim=-1)
            sorted_y = sorted_y.masked_fill(sorted_p.cumsum(dim=-1) - sorted_p > plan.floats[2][:, None], float("-inf"))
            y = y.scatter(-1, idx, sorted_y)
        # Inverse-CDF draw: one counter-based uniform per row, no generator, no host sync.
        cdf = y.softmax(dim=-1).cumsum(dim=-1)
        u = counter_uniform(plan.ints[2], plan.ints[3]) * cdf[:, -1]
        return torch.searchsorted(cdf, u[:, None], right=True).squeeze(1).clamp_(max=vocab - 1)

    def release(self, row: int) -> None:
        self._row.pop(row, None)
        self._matchers.pop(row, None)

    def clear(self) -> None:
        self._row.clear()
        self._matchers.clear()
        self._seen = self._suppress = self._begin = None
