"""Typed errors. Each message names the problem and the fix."""

from __future__ import annotations


class OnecopyError(Exception):
    """Base class of every error onecopy raises on purpose."""


class ModelSourceError(OnecopyError):
    """A model source (checkpoint dir, GGUF file, preset name) cannot be read or is unsupported."""


class ExportError(OnecopyError):
    """Exporting a model into a bundle failed; nothing was written."""


class BundleError(OnecopyError):
    """A bundle is missing, corrupt or does not match this runtime; nothing was loaded."""


class BundleNotFoundError(BundleError):
    """The bundle directory or one of its files is missing."""


class ManifestError(BundleError):
    """manifest.json is unreadable, truncated or lacks required fields."""


class UnknownWeightLayoutError(ManifestError):
    """A packed weight's layout is not one this runtime reads (a newer onecopy wrote it)."""


class UnsupportedFormatVersionError(BundleError):
    """The bundle's format version is not one this runtime reads."""


class WeightsCorruptError(BundleError):
    """The weight file's bytes do not match the manifest's content hashes."""


class WeightSpecError(BundleError):
    """A weight is missing, or its shape or dtype differs from the manifest."""


class CoverageError(BundleError):
    """A method needs constants that the bundle does not provide (or provides unexpected ones)."""


class TorchVersionMismatchError(BundleError):
    """The bundle's packages were compiled by another torch release than the one running."""


class DeviceMismatchError(BundleError):
    """The bundle was compiled for another device kind than the one asked for."""


class ToolchainError(OnecopyError):
    """A compiled package cannot be loaded safely into this process (C++ runtime mismatch)."""


class EngineClosedError(OnecopyError):
    """The Engine was closed; load it again."""


class EngineFailedError(OnecopyError):
    """A device call failed, so the engine serves no more (fail closed: the device's state is unknown, and a
    CUDA error is sticky); its message names a reference into the log, ``__cause__`` is the raw error. Load
    the bundle again in a new process."""


class SessionClosedError(OnecopyError):
    """The session was closed; open a new one."""


class SessionCapacityError(OnecopyError):
    """No room for another session."""


class QueueFullError(SessionCapacityError):
    """Every row is taken and the scheduler's queue holds max_queue requests already."""


class InputError(OnecopyError):
    """A method input or a prompt does not fit what the bundle was compiled for."""


class PromptTooLongError(InputError):
    """The prompt does not fit in the bundle's max_seq_len."""
