"""The bundle's tokenizer and chat template, and incremental detokenization for streaming."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from .errors import InputError


class Tokenizer:
    """A `tokenizers` tokenizer plus the bundle's Jinja chat template."""

    def __init__(self, tokenizer_json: str, chat_template: str | None = None, bos_token_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_str(tokenizer_json)
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id

    @classmethod
    def from_file(cls, path: Path, chat_template: str | None = None, bos_token_id: int | None = None) -> "Tokenizer":
        return cls(Path(path).read_text(), chat_template, bos_token_id)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @staticmethod
    def _env() -> Any:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            # transformers' filter, not Jinja's (which sorts keys and escapes non-ASCII and <>&'): templates render
            # tools and call arguments with it, and the model was trained on this form
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = tojson
        return env

    @functools.cached_property
    def _template(self) -> Any:
        """The chat template compiled (once: every chat request renders it)."""
        return self._env().from_string(self.chat_template)

    @functools.cached_property
    def takes_tools(self) -> bool:
        """Whether the chat template renders tool definitions itself (it reads a ``tools`` variable)."""
        if not self.chat_template:
            return False
        from jinja2 import meta

        return "tools" in meta.find_undeclared_variables(self._env().parse(self.chat_template))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render the template as transformers does (sandboxed Jinja, trim_blocks, lstrip_blocks; ``tools`` passed
        as its ``tools`` variable when given). InputError when the template refuses the messages (its
        ``raise_exception``, e.g. roles out of the order it takes)."""
        if not self.chat_template:
            raise InputError("this bundle has no chat template; pass raw=True (--raw) to send the prompt as is")
        from jinja2.exceptions import TemplateError

        template = self._template
        extra = {"tools": tools} if tools else {}
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)
        except TemplateError as e:
            raise InputError(f"the model's chat template refuses these messages: {e}") from None


class TextStream:
    """Turns a growing list of ids into text pieces, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self.emitted = tokenizer, [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.emitted = text[len(self.emitted):], text
        return piece
