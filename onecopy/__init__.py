"""onecopy: serve exported multi-method PyTorch models from one copy of the weights on one device."""

from .errors import *  # noqa: F401,F403  (the typed errors are part of the public API)
from .export.exporter import export
from .runtime.config import EngineConfig
from .runtime.engine import Engine
from .runtime.memory import MemoryReport
from .runtime.stream import TokenStream
from .runtime.session import Session, Slot, Token
from .params import SamplingParams

__all__ = ["Engine", "EngineConfig", "MemoryReport", "SamplingParams", "Session", "Slot", "Token", "TokenStream", "export"]
__version__ = "0.1.0"
