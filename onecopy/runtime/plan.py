"""What the scheduler decides and the model runner carries out: step plans and state operations.

State operations are the device work that host-side decisions imply (a block copied on write, fresh
blocks zeroed, a row's block table rewritten, a released row zeroed, a block saved to or loaded from the
host and disk tiers). The scheduler and the KV cache
manager only queue them (`StateOps`); the model runner applies them, in order, before the next thing
it runs on the device (the next step, or a session's direct call). Host only: no tensors here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..params import SamplingParams
from .request import Request


@dataclass(frozen=True)
class CopyBlock:
    """Copy KV block ``src`` into ``dst`` (copy on write: a row is about to write a block others read)."""

    src: int
    dst: int


@dataclass(frozen=True)
class ZeroBlocks:
    """Zero fresh KV blocks: what a row holds past its position never depends on who held it before."""

    blocks: tuple[int, ...]


@dataclass(frozen=True)
class SetTable:
    """Row ``row``'s block table entries from ``start`` on name ``blocks``."""

    row: int
    start: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class ClearTable:
    """Row ``row``'s block table entries from ``start`` on point at the scratch block."""

    row: int
    start: int


@dataclass(frozen=True)
class ZeroRow:
    """Zero a released row of the state pool and forget its sampling state."""

    row: int


@dataclass(frozen=True)
class SaveBlock:
    """Copy KV block ``block`` to host slot ``slot`` (the prefix cache evicts it: `kv_tiers`)."""

    block: int
    slot: int


@dataclass(frozen=True)
class LoadBlock:
    """Copy host slot ``slot`` into KV block ``block`` (a cached prefix loaded instead of prefilled)."""

    slot: int
    block: int


@dataclass(frozen=True)
class SpillSlot:
    """Write host slot ``slot`` to the disk tier's file of prefix ``key`` (the slot is about to be reused)."""

    slot: int
    key: bytes


@dataclass(frozen=True)
class SaveFile:
    """Write KV block ``block`` to the file of prefix ``key`` (an engine closing: `kv_tiers.TierIndex.persist`)."""

    block: int
    key: bytes


@dataclass(frozen=True)
class LoadFile:
    """Write a disk tier file's checked payload (read when the load was decided: a host tensor of
    `tier_store.TierStore.read`) into KV block ``block``."""

    payload: Any
    block: int


@dataclass(frozen=True)
class DropFile:
    """Delete the file of prefix ``key`` (the disk tier is full)."""

    key: bytes


TierOp = SaveBlock | LoadBlock | SpillSlot | SaveFile | LoadFile | DropFile
StateOp = CopyBlock | ZeroBlocks | SetTable | ClearTable | ZeroRow | TierOp


class StateOps:
    """The queue of state operations decided and not yet applied (the scheduler's; callers hold the
    engine's lock)."""

    def __init__(self) -> None:
        self._ops: list[StateOp] = []
        self.taken = 0  # batches taken: an operation queued in batch ``taken`` is applied after this count moves

    def add(self, *ops: StateOp) -> None:
        self._ops.extend(ops)

    def take(self) -> list[StateOp]:
        """Every queued operation, in the order decided; the queue is empty afterwards."""
        out, self._ops = self._ops, []
        self.taken += 1
        return out

    def __len__(self) -> int:
        return len(self._ops)


@dataclass(frozen=True)
class RequestStart:
    """Set a request up on its row before its first chunk: its sampling state (``seen``: the ids the
    repetition penalty starts from; ``seed``: its draws'), its encode inputs."""

    row: int
    params: SamplingParams
    seen: list[int]
    encode_inputs: tuple[Any, ...] | None
    seed: int
    emitted: list[int] = field(default_factory=list)  # ids it generated before a preemption (its grammar replays them)


@dataclass
class PrefillChunk:
    """Prompt ids ``tokens`` of ``request`` into its row from position ``start``."""

    request: Request
    row: int
    start: int
    tokens: list[int]


@dataclass
class StepPlan:
    """One iteration's device work, decided by `Scheduler.schedule` and executed by the model runner."""

    state_ops: list[StateOp] = field(default_factory=list)  # applied first, in order
    starts: list[RequestStart] = field(default_factory=list)  # then these requests are set up
    prefills: list[PrefillChunk] = field(default_factory=list)  # run next, in this order
    decode_rows: list[int] = field(default_factory=list)  # one batched decode step over these rows...
    decode_positions: list[int] = field(default_factory=list)  # ...at these positions
    fed: list[tuple[int, int]] = field(default_factory=list)  # (row, prompt id): its decode input is this id
    # Whose logits are sampled, in this order: (request, index into the decode rows, or -1 - i: prefills[i]'s).
    sample: list[tuple[Request, int]] = field(default_factory=list)
    sample_positions: list[int] = field(default_factory=list)  # each sampled row's position after the step
    sample_first: list[bool] = field(default_factory=list)  # its request's first sampled token

    @property
    def prefill(self) -> PrefillChunk | None:
        """The first prefill chunk (the only one without a token budget), or None."""
        return self.prefills[0] if self.prefills else None

    @property
    def sampled(self) -> list[Request]:
        return [r for r, _ in self.sample]

    @property
    def sample_rows(self) -> list[int]:
        return [r.row for r, _ in self.sample]
