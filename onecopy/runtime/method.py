"""One compiled method (an AOTInductor package) bound to the engine's weights and a session's state."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..bundle import MethodSpec, parse_dtype
from ..errors import CoverageError, InputError
from ..export.toolchain import check_package_loadable
from .weights import WeightStore


class Method:
    """A loaded package. Weightless packages get every constant from outside (user-managed)."""

    def __init__(self, spec: MethodSpec, package: Path, device: torch.device, state_fqns: set[str]) -> None:
        """Load ``package``; ``state_fqns`` are the bundle's declared per-session state FQNs."""
        check_package_loadable(package)
        self.spec, self.device = spec, device
        self.state_fqns = [c for c in spec.constants if c in state_fqns]
        self.weight_fqns = [c for c in spec.constants if c not in state_fqns]
        self.bound_session: int | None = None  # id of the session whose state the runner points at
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._compiled = torch._inductor.aoti_load_package(str(package))
        found, declared = set(self._compiled.get_constant_fqns()), set(spec.constants)
        # A package with its own constants may fold some away; it must still expose its state to rebind.
        ok = found == declared if spec.weights == "external" else (set(self.state_fqns) <= found <= declared)
        if not ok:
            self.close()
            raise CoverageError(
                f"method {spec.name!r}: the package needs constants {sorted(found ^ declared)[:5]} that the "
                "manifest does not declare (or the reverse); the package and manifest are from different exports: export again")
        self._run = self._compiled.loader.boxed_run  # skips the pytree work of AOTICompiledModel.__call__
        self.weights_bound = False
        self.bound: dict[str, int] = {}  # fqn -> data_ptr of what the runner reads (for accounting and tests)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def embeds_weights(self) -> bool:
        return self.spec.weights == "embedded"

    def bind(self, store: WeightStore, state: dict[str, torch.Tensor]) -> None:
        """Point the runner at ``state`` (and, the first time, at the shared weights in ``store``)."""
        state = {k: state[k] for k in self.state_fqns}
        if self.embeds_weights:
            self._compiled.load_constants(state, check_full_update=False, user_managed=True)
        elif not self.weights_bound:
            weights = store.as_map(self.weight_fqns)  # only the first bind needs them: later ones re-point state
            self._compiled.load_constants({**weights, **state}, check_full_update=True, user_managed=True)
            self.weights_bound = True
            self.bound.update({k: v.data_ptr() for k, v in weights.items()})
        else:
            self._compiled.load_constants(state, check_full_update=False, user_managed=True)
        self.bound.update({k: v.data_ptr() for k, v in state.items()})

    def check_inputs(self, args: tuple[torch.Tensor, ...]) -> None:
        specs = self.spec.inputs
        if len(args) != len(specs):
            raise InputError(f"{self.name} takes {len(specs)} inputs ({', '.join(s.name for s in specs)}), got {len(args)}")
        for a, s in zip(args, specs):
            if not isinstance(a, torch.Tensor):
                raise InputError(f"{self.name} input {s.name!r} must be a tensor, got {type(a).__name__}")
            if a.dtype != parse_dtype(s.dtype):
                raise InputError(f"{self.name} input {s.name!r} must be {s.dtype}, got {str(a.dtype)[6:]}; cast it")
            if a.device.type != self.device.type:
                raise InputError(f"{self.name} input {s.name!r} must be on {self.device.type}, got {a.device}; move it")
            ok = a.dim() == len(s.shape) and all(
                (d == want) if isinstance(want, int) else (want["min"] <= d <= want["max"])
                for d, want in zip(a.shape, s.shape))
            if not ok:
                raise InputError(f"{self.name} input {s.name!r} has shape {list(a.shape)}, compiled for {s.shape}")

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        out = self._run(list(args))
        return out[0] if len(out) == 1 else out

    def close(self) -> None:
        self._compiled = None
        self._run = None
