"""What every model family gives the exporter: its methods as modules with example inputs."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..bundle import InputSpec


@dataclass
class MethodDef:
    """What the exporter needs for one method: a module whose forward is the method, and inputs."""

    module: nn.Module
    args: tuple[torch.Tensor, ...]
    dynamic_shapes: tuple
    inputs: list[InputSpec]


def as_method(module: nn.Module, fn: Any) -> nn.Module:
    """A shallow view of ``module`` whose forward is ``fn``: same parameters, same FQNs."""
    view = copy.copy(module)
    view.__class__ = type(f"{type(module).__name__}_{fn.__name__}", (type(module),), {"forward": fn})
    return view


