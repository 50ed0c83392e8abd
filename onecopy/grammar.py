"""Constrained decoding: a request's output held to a JSON schema, any JSON object, a regex or a Lark grammar.

The grammar engine is llguidance (Rust; no dependencies; its token masks take tens of microseconds a step at the
median, and a grammar compiles lazily as the output grows, so a new schema costs milliseconds, not seconds).
Per step each constrained row's allowed tokens come from its matcher as a bitmask (one bit a token) on the
host, copied with the step's other parameters, and the on-device sampler sets every other token's logit to
-inf before the penalty, temperature, top-k and top-p (`sampling.BatchSampler`): rows without a grammar are
untouched. The matcher follows the row's tokens (`advance`): a step's ids reach it while the next step's forward
pass runs, before that step's masks are made (`runtime.runner`). When the grammar is complete only the
end-of-sequence ids stay allowed, and the request stops there.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import InputError

KINDS = ("json_schema", "json_object", "regex", "lark")


class GrammarError(InputError):
    """A grammar the engine cannot use (its reason), or a tokenizer it cannot run on."""


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match: ``kind`` (one of `KINDS`) and its text (canonical JSON for a schema)."""

    kind: str
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> "Grammar":
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))  # key order kept: it orders the output

    @classmethod
    def json_object(cls) -> "Grammar":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> "Grammar":
        return cls("lark", grammar)

    @property
    def key(self) -> str:
        """The compile cache's key: a hash of the kind and text."""
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()

    def llguidance(self) -> str:
        """The grammar in llguidance's own form. JSON is compact (no whitespace between tokens: a small model
        otherwise may emit whitespace until its tokens run out)."""
        import llguidance

        compact = {"whitespace_flexible": False}
        if self.kind == "json_schema":
            schema = json.loads(self.text)
            if isinstance(schema, dict):
                schema = {**schema, "x-guidance": {**compact, **schema.get("x-guidance", {})}}
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object", "x-guidance": compact})
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.text)
        return llguidance.LLMatcher.grammar_from_lark(self.text)


class Matcher:
    """One request's place in its grammar: the tokens allowed next, advanced by each token it emits."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill(self, out: np.ndarray) -> None:
        """Write the allowed tokens' bitmask (int32 [words]; bit t % 32 of word t // 32) into ``out``."""
        import llguidance.numpy as lnp

        lnp.fill_next_token_bitmask(self._m, out.reshape(1, -1), 0)

    def advance(self, token: int) -> None:
        """Take the emitted ``token`` (one the mask allowed). A token it refuses (an end-of-sequence id after a
        stop, say) leaves it stopped: every later mask allows only the end-of-sequence ids."""
        self._m.consume_token(token)


class GrammarCompiler:
    """The bundle tokenizer in llguidance's form (built at the first grammar: ~0.5 s) and the grammars checked
    against it, cached by `Grammar.key`. Thread-safe: requests are checked on the callers' threads."""

    def __init__(self, tokenizer_json: Path | str, eos_ids: Sequence[int], vocab_size: int) -> None:
        self._json, self.eos_ids, self.vocab_size = tokenizer_json, list(eos_ids), vocab_size
        self._tokenizer: Any = None
        self._grammars: dict[str, str] = {}
        self._lock = threading.Lock()

    def _tok(self) -> Any:
        if self._tokenizer is None:
            try:
                import llguidance
            except ImportError as e:  # a dependency of onecopy: only a broken install lacks it
                raise GrammarError("constrained decoding needs the llguidance package: pip install llguidance") from e
            if not self.eos_ids:
                raise GrammarError("this bundle names no end-of-sequence id: a grammar could never end its output")
            text = Path(self._json).read_text() if isinstance(self._json, Path) else self._json
            try:
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_ids)
            except Exception as e:  # llguidance's own error: the tokenizer's kind, not the request
                raise GrammarError(f"this bundle's tokenizer cannot run constrained decoding: {e}") from e
        return self._tokenizer

    def compile(self, grammar: Grammar) -> str:
        """``grammar`` in llguidance's form, checked against the tokenizer (cached). GrammarError with the
        engine's reason for a grammar it cannot use (an unknown schema keyword, a bad regex)."""
        import llguidance

        with self._lock:
            done = self._grammars.get(grammar.key)
            if done is not None:
                return done
            tok = self._tok()
            try:
                text = grammar.llguidance()
                is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tok)
            except (ValueError, RuntimeError, TypeError) as e:
                raise GrammarError(f"the {grammar.kind} cannot be compiled: {e}") from e
            if is_error:
                raise GrammarError(f"the {grammar.kind} cannot be compiled: {messages[0].strip()}")
            self._grammars[grammar.key] = text
            return text

    def matcher(self, grammar: Grammar, emitted: Sequence[int] = ()) -> Matcher:
        """A fresh matcher of ``grammar``, advanced over ``emitted`` (the ids a resumed request already has)."""
        import llguidance

        text = self.compile(grammar)
        m = Matcher(llguidance.LLMatcher(self._tok(), text))
        for t in emitted:
            m.advance(t)
        return m
