"""The weight store: each weight FQN once on the device, owned by one Engine."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..bundle import Bundle


class WeightStore:
    """Device tensors keyed by (FQN, content hash), so equal names from different exports never mix."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tensors: dict[tuple[str, str], torch.Tensor] = {}
        self._hash: dict[str, str] = {}

    def load(self, bundle: Bundle, fqns: Iterable[str]) -> None:
        """Copy the named weights to the device; those already present are not loaded again."""
        for fqn in sorted(set(fqns)):
            key = (fqn, bundle.manifest.weights[fqn].sha256 or "")
            if key in self._tensors:
                continue
            self._tensors[key] = bundle.weights[fqn].to(self.device, copy=True)
            self._hash[fqn] = key[1]

    def get(self, fqn: str) -> torch.Tensor:
        return self._tensors[(fqn, self._hash[fqn])]

    def as_map(self, fqns: Iterable[str]) -> dict[str, torch.Tensor]:
        return {f: self.get(f) for f in fqns}

    def tensors(self) -> list[torch.Tensor]:
        return list(self._tensors.values())

    def __contains__(self, fqn: str) -> bool:
        return fqn in self._hash

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def clear(self) -> None:
        """Free every weight's memory now, even though AOTI runners still reference the tensors.

        Measured (torch 2.13): a runner given user-managed constants keeps references to them even
        after the runner is deleted, so dropping our own references frees nothing. Shrinking each
        storage to zero bytes returns the memory; no runner reads it again.
        """
        for t in self._tensors.values():
            t.untyped_storage().resize_(0)
        self._tensors.clear()
        self._hash.clear()
