"""Session state: one device allocation per session, carved into the manifest's state tensors.

One allocation (not one per tensor) makes a session's cost exact and its release a single
operation; snapshots move it to host memory or a safetensors file and back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..bundle import TensorSpec, parse_dtype
from ..errors import InputError

_ALIGN = 256  # bytes; keeps every state tensor as aligned as a separate cudaMalloc would


def state_layout(specs: dict[str, TensorSpec]) -> tuple[dict[str, int], int]:
    """Byte offset of each state tensor inside the session buffer, and the buffer size."""
    offsets, size = {}, 0
    for fqn in sorted(specs):
        size = (size + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets[fqn] = size
        size += specs[fqn].nbytes
    return offsets, size


class SessionState:
    """The tensors one session owns, all views of one buffer."""

    def __init__(self, specs: dict[str, TensorSpec], device: torch.device) -> None:
        offsets, size = state_layout(specs)
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self.tensors: dict[str, torch.Tensor] = {}
        for fqn, spec in specs.items():
            if spec.init not in (None, "zeros"):
                raise InputError(f"state {fqn!r} has init rule {spec.init!r}; this onecopy knows 'zeros'")
            start = offsets[fqn]
            self.tensors[fqn] = self.buffer[start:start + spec.nbytes].view(parse_dtype(spec.dtype)).view(spec.shape)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for this session (tensors plus alignment padding)."""
        return self.buffer.untyped_storage().nbytes()

    def zero_(self) -> None:
        self.buffer.zero_()

    def release(self) -> None:
        """Free the device memory now, even if a runner still references the tensors."""
        self.buffer.untyped_storage().resize_(0)
        self.tensors = {}


@dataclass
class SessionSnapshot:
    """A session's state and position in host memory; `Engine.open_session(restore=...)` resumes it."""

    state: dict[str, torch.Tensor]
    position: int
    fingerprint: str  # identifies the bundle the state belongs to

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.state.items()}, str(path),
                  metadata={"onecopy": json.dumps({"position": self.position, "fingerprint": self.fingerprint})})

    @classmethod
    def load(cls, path: str | Path) -> "SessionSnapshot":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("onecopy", "null"))
                state = {k: f.get_tensor(k) for k in f.keys()}
        except FileNotFoundError as e:
            raise InputError(f"snapshot {path} does not exist; save one with session.save(path)") from e
        except Exception as e:
            raise InputError(f"{path} is not a readable session snapshot ({e}); save one with session.save(path)") from e
        if not meta:
            raise InputError(f"{path} is a safetensors file but not an onecopy session snapshot")
        return cls(state=state, position=int(meta["position"]), fingerprint=meta["fingerprint"])
