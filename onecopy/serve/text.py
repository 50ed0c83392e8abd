"""Streaming text for a request: incremental detokenization and stop strings."""

from __future__ import annotations

from ..tokenizer import TextStream, Tokenizer


class StopText:
    """Cuts generated text at the first stop string, holding back only a tail that may start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.buffer = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        """Text that is safe to emit now (never part of a stop string)."""
        if self.stopped:
            return ""
        self.buffer += piece
        hits = [i for i in (self.buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buffer, self.stopped = self.buffer[:min(hits)], "", True
            return out
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(self.buffer)), 0, -1)
                    if self.buffer.endswith(s[:k])), default=0)
        out, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return out

    def flush(self) -> str:
        """What was held back, once generation ended without a stop string."""
        out, self.buffer = ("" if self.stopped else self.buffer), ""
        return out


class ReplyText:
    """Token ids in, emittable text out (UTF-8 completed, stop strings cut)."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]) -> None:
        self.stream = TextStream(tokenizer)
        self.stop = StopText(stops)

    @property
    def stopped(self) -> bool:
        return self.stop.stopped

    def push(self, token_id: int) -> str:
        return self.stop.push(self.stream.push(token_id))

    def flush(self) -> str:
        return self.stop.flush()
