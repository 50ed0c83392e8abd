"""Session snapshots: one session's state rows and position in host memory or a safetensors file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InputError


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
