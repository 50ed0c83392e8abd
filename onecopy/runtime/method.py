"""One compiled method (an AOTInductor package), its weights bound once from the engine's store.

The package takes its user inputs, then the rows it works on, then the state pools. State is
never bound as a constant: every call names its rows, so nothing is re-pointed between sessions.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..bundle import MethodSpec, parse_dtype
from ..errors import CoverageError, DeviceMismatchError, InputError, ManifestError
from ..toolchain import check_package_loadable
from .weights import WeightStore

_RANGE_HINTS = {"tokens": "token ids must lie in the vocabulary", "input_pos": "positions must lie below max_seq_len"}


class Method:
    """A loaded package. Weightless packages get every constant from the store (user-managed)."""

    def __init__(self, spec: MethodSpec, package: Path, device: torch.device) -> None:
        self._compiled = self._run = None  # nothing loaded yet (close() and the refusal tests rely on it)
        check_package_loadable(package)
        self.spec, self.device = spec, device
        _load_native_ops(spec, device)
        self.weight_fqns = list(spec.constants)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._compiled = torch._inductor.aoti_load_package(str(package))
        found, declared = set(self._compiled.get_constant_fqns()), set(spec.constants)
        # A package with its own constants may fold some away; a weightless one must match exactly.
        ok = found == declared if spec.weights == "external" else found <= declared
        if not ok:
            self.close()
            raise CoverageError(
                f"method {spec.name!r}: the package needs constants {sorted(found ^ declared)[:5]} that the "
                "manifest does not declare (or the reverse); the package and manifest are from different exports: export again")
        self._run = self._compiled.loader.boxed_run  # skips the pytree work of AOTICompiledModel.__call__
        self.bound: dict[str, int] = {}  # fqn -> data_ptr of what the runner reads (for accounting and tests)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def embeds_weights(self) -> bool:
        return self.spec.weights == "embedded"

    def bind_weights(self, store: WeightStore) -> None:
        """Point the runner at the shared weights (once; embedded packages keep their own)."""
        if self.embeds_weights:
            return
        weights = store.as_map(self.weight_fqns)
        self._compiled.load_constants(weights, check_full_update=True, user_managed=True)
        self.bound = {k: v.data_ptr() for k, v in weights.items()}

    def check_inputs(self, args: tuple[torch.Tensor, ...]) -> None:
        """Count, dtype, device, shape and value range of the user inputs; InputError before any kernel runs.

        Value ranges (token ids, positions) are read on the host: for device tensors that is one
        small copy, paid only on this checked path (the scheduler feeds ids it validated itself).
        """
        specs = self.spec.inputs
        if len(args) != len(specs):
            raise InputError(f"{self.name} takes {len(specs)} inputs ({', '.join(s.name for s in specs)}), got {len(args)}")
        for a, s in zip(args, specs):  # every check of one input before the next input's
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
            if s.range is not None and a.numel():
                lo, hi = (int(v) for v in torch.aminmax(a.detach()))
                if lo < s.range[0] or hi >= s.range[1]:
                    bad = lo if lo < s.range[0] else hi
                    hint = _RANGE_HINTS.get(s.name, "each value must lie in the range")
                    raise InputError(f"{self.name} input {s.name!r} holds {bad}, outside [{s.range[0]}, {s.range[1]}): "
                                     f"{hint}")
        batch = {a.shape[0] for a, s in zip(args, specs) if isinstance(s.shape[0], dict)}
        if self.role == "decode" and len(batch) > 1:
            raise InputError(f"{self.name} inputs disagree on the batch size: {sorted(batch)}; give one entry per session")

    def __call__(self, *args: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """Run with (user inputs..., rows, *pools); one output is returned as is, several as a list."""
        out = self._run(list(args))
        return out[0] if len(out) == 1 else out

    def close(self) -> None:
        self._compiled = None
        self._run = None


def _load_native_ops(spec: MethodSpec, device: torch.device) -> None:
    """Load the op libraries the package calls by name (`kernels.native` on CUDA, `kernels.cpu` on the CPU)
    before the package itself: its proxy executor looks each op up as it loads. ToolchainError if they cannot
    be built here."""
    from ..kernels import cpu, native

    unknown = sorted(set(spec.native_ops) - {native.LIBRARY, cpu.LIBRARY})
    if unknown:
        raise ManifestError(f"method {spec.name!r} calls op libraries {unknown} that this onecopy does not have; "
                            "export the bundle again with this onecopy")
    if native.LIBRARY in spec.native_ops:
        if device.type != "cuda" or not torch.cuda.is_available():
            raise DeviceMismatchError(f"method {spec.name!r} calls the native CUDA kernels ({native.LIBRARY}); "
                                      "load the bundle on the CUDA device it was exported for")
        native.load()
    if cpu.LIBRARY in spec.native_ops:
        if device.type != "cpu":
            raise DeviceMismatchError(f"method {spec.name!r} calls the CPU kernels ({cpu.LIBRARY}); load the bundle "
                                      "on the CPU it was exported for")
        cpu.load()
