"""The state pool: every state tensor with a leading row dimension, one row per session, one allocation.

Rows 0..rows-1 belong to sessions; row ``rows`` is scratch: batched calls pad with it, so padding
never writes a live session. Who holds a row is the scheduler's (`rows.RowAllocator`); a released
row is zeroed here before anything runs on it again (a `plan.ZeroRow`). The pool is allocated once,
at load, so opening and closing sessions moves no device memory.
"""

from __future__ import annotations

import torch

from ..bundle import TensorSpec, parse_dtype
from ..errors import InputError

_ALIGN = 256  # bytes; keeps every pool tensor as aligned as a separate cudaMalloc would


def carve(specs: dict[str, TensorSpec], count: int, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One zeroed buffer and, per FQN, a [count, *spec.shape] tensor carved from it (manifest order)."""
    offsets, size = {}, 0
    for fqn in sorted(specs):
        size = -(-size // _ALIGN) * _ALIGN
        offsets[fqn] = size
        size += count * specs[fqn].nbytes
    buffer = torch.zeros(max(size, 1), dtype=torch.uint8, device=device)
    tensors = {}
    for fqn, spec in specs.items():  # manifest order: the order methods take them in
        start, n = offsets[fqn], count * spec.nbytes
        tensors[fqn] = buffer[start:start + n].view(parse_dtype(spec.dtype)).view(count, *spec.shape)
    return buffer, tensors


class StatePool:
    """Pool tensors [rows + 1, *shape] per state FQN, carved from one buffer."""

    def __init__(self, specs: dict[str, TensorSpec], rows: int, device: torch.device) -> None:
        for fqn, spec in specs.items():
            if spec.init not in (None, "zeros"):
                raise InputError(f"state {fqn!r} has init rule {spec.init!r}; this onecopy knows 'zeros'")
        self.rows, self.scratch, self.device = rows, rows, device
        self.row_bytes = sum(s.nbytes for s in specs.values())
        self.buffer, self.tensors = carve(specs, rows + 1, device)

    @property
    def nbytes(self) -> int:
        """Device bytes of the whole pool (every row, the scratch row and alignment)."""
        return self.buffer.untyped_storage().nbytes()

    def row(self, row: int) -> dict[str, torch.Tensor]:
        """Views of one row of every state tensor, by FQN."""
        return {fqn: t[row] for fqn, t in self.tensors.items()}

    def zero_row(self, row: int) -> None:
        if self.tensors:
            torch._foreach_zero_([t[row] for t in self.tensors.values()])

    def release_memory(self) -> None:
        """Free the device memory now, even if a compiled runner still references the tensors."""
        self.buffer.untyped_storage().resize_(0)
        self.tensors = {}
