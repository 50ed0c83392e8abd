"""Seeded random Qwen3.5 layers for the kernel tests (GPU tests and the interpreter checks build them alike)."""

from __future__ import annotations

import dataclasses

import torch

from onecopy.models.presets import PRESETS
from onecopy.models.qwen3_5 import Experts
from onecopy.models.qwen3_5_deltanet import GatedDeltaNet


def random_deltanet(**changes) -> GatedDeltaNet:
    """A DeltaNet layer of the tiny preset's config with ``changes`` (its heads), weights drawn from seed 0 at
    scales that keep the state and the output near 1 (norms and gates 0.3, matrices 1 / sqrt(fan-in))."""
    torch.manual_seed(0)
    m = GatedDeltaNet(dataclasses.replace(PRESETS["tiny-qwen3.5"].config, **changes))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() < 2 else p.shape[-1] ** -0.5))
    return m


def random_experts(e: int, d: int, inter: int) -> Experts:
    """``e`` routed experts (width ``inter`` over ``d``), weights drawn from seed 0 at 1 / sqrt(fan-in)."""
    torch.manual_seed(0)
    ex = Experts(e, d, inter)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(e, 2 * inter, d) / d ** 0.5)
        ex.down_proj.copy_(torch.randn(e, d, inter) / inter ** 0.5)
    return ex
