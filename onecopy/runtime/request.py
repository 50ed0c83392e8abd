"""A generation request and its progress: host-only bookkeeping that the scheduler owns.

A request runs on one row of the state pool: a row it takes at admission and gives back when it ends
(``owns_row``), or the row of a session the caller named. Its progress (the row's position, the prompt
tokens in the state, the ids sampled) lives here, not on a session: the engine reads the outcome when
the request has ended.

A request on an empty row may be preempted when KV blocks run out (`scheduler.Scheduler`): its row is
emptied (it keeps the row) and it waits again; when it is admitted again its row is refilled with its
prompt and the ids it already streamed (``resumed`` of them), and it samples on from there with the
same seed, so its stream has no gap and no repeat.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ..params import SamplingParams
from .rows import RowLease


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for a row (or for KV blocks), or preempted
    PREFILLING = "prefilling"  # admitted, its prompt not all in the state yet
    DECODING = "decoding"  # generating
    FINISHED = "finished"  # see finish_reason


@dataclass(eq=False)  # identity: a request is itself, whatever its fields hold
class Request:
    """One generation request and where it stands. ``stream`` and ``encode_inputs`` are opaque here."""

    id: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    lease: RowLease | None = None  # its row of the state pool: a session's (given), or taken at admission
    owns_row: bool = True  # the row is taken at admission and given back when the request ends...
    keep_row: bool = False  # ...unless this: it ended well, and the row stays held (a kept session)
    start: int = 0  # the row's position before the prompt
    base: list[int] | None = field(default_factory=list)  # the ids the row holds before the prompt (None: unknown)
    encode_inputs: tuple[Any, ...] | None = None  # the encode method's inputs, run on the row at admission
    stream: Any = None  # the consumer's handle
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    error: BaseException | None = None
    cancel_requested: bool = False  # set by any thread; the scheduler ends the request at its next admission
    admitted: bool = False  # got its row (stays true after it finishes)
    cached: int = 0  # prompt tokens found in the prefix cache: in the state at admission, not prefilled
    fed: int = 0  # prompt tokens in the state so far (the cached ones included)
    position: int = 0  # the row's next write position (counts the steps planned, not only those done)
    launched: int = 0  # tokens sampled on the device
    output: list[int] = field(default_factory=list)  # sampled ids that came back, in order
    exhausted: bool = False  # its last token is launched: no more steps
    seed: int | None = None  # its sampling seed, drawn at the first admission and kept through preemptions
    resumed: int = 0  # generated ids its row reads again after a preemption, after the prompt
    preemptions: int = 0  # times its row was emptied for others' KV blocks
    reserve: bool = False  # preempted with no other request to take blocks from: it waits for all it may write
    arrival: int = 0  # its place in the order the scheduler was given requests
    # The KV tiers' keys (`kv_tiers.prefix_digest`) of the whole blocks it reads, by block index, as far as
    # looked up: admission asks more than once, and a 4k-token prompt's chain is 256 digests.
    digests: dict[int, bytes] = field(default_factory=dict, repr=False)

    @property
    def row(self) -> int:
        assert self.lease is not None, "a request has a row once admitted"
        return self.lease.row

    @property
    def needs_row(self) -> bool:
        """Whether admission must lease it a row (a preempted request keeps the one it has)."""
        return self.owns_row and self.lease is None

    @property
    def starts_empty(self) -> bool:
        """Whether its row holds nothing when it is admitted: a row of its own, or one a preemption emptied
        (such a request waits in line for KV blocks, and may start on cached prefix blocks)."""
        return self.owns_row or self.preemptions > 0

    @property
    def feed_len(self) -> int:
        """Ids the row reads before the next sample: the prompt and, after a preemption, the ids resumed."""
        return len(self.prompt) + self.resumed

    def feed(self, start: int, end: int) -> list[int]:
        """Ids [start, end) of what the row reads (the prompt, then the resumed ids)."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt if start == 0 and end == n else self.prompt[start:end]  # read-only: no copy
        return self.prompt[start:n] + self.output[max(start - n, 0):end - n]

    @property
    def reading_prompt(self) -> bool:
        return self.fed < self.feed_len

    @property
    def generated(self) -> int:
        return len(self.output)

    @property
    def end(self) -> int:
        """The row's position once the request has ended: its prompt and every id fed back (the last
        id was sampled, never fed; steps planned after a stop id are undone)."""
        return min(self.position, self.start + len(self.prompt) + max(self.generated - 1, 0))

    @property
    def held(self) -> list[int] | None:
        """The ids the row holds once the request has ended (None: unknown, or the request failed)."""
        if self.base is None or self.finish_reason == "error":
            return None
        return (self.base + self.prompt + self.output)[:self.end]
