"""CUDA graph slots: one captured decode per session slot, all graphs in one shared memory pool.

Measured (DESIGN.md): a loaded AOTI runner that was captured is replay-only, and a captured graph
keeps the addresses of the state it was captured with. So each slot owns its state and its own
runner (bound to the engine's shared weights), captured once against that state; a session
borrows a slot and switching sessions costs no re-pointing and no copy.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..bundle import MethodSpec, TensorSpec
from .method import Method
from .state import SessionState
from .weights import WeightStore
from .workspace import Workspace

WARMUP_RUNS = 2


class GraphSlot:
    """A session slot: its state and a decode graph captured against it."""

    def __init__(self, index: int, spec: MethodSpec, package: Path, device: torch.device, store: WeightStore,
                 state_specs: dict[str, TensorSpec], workspace: Workspace, pool: tuple[int, int],
                 warmup_stream: torch.cuda.Stream) -> None:
        t0 = time.perf_counter()
        free_before = torch.cuda.mem_get_info(device)[0]
        self.index = index
        self.state = SessionState(state_specs, device)
        self.runner = Method(spec, package, device, set(state_specs))
        self.runner.bind(store, self.state.tensors)
        # Static inputs are shared by every slot: replays run in stream order, each after its own copy-in.
        self.tokens = workspace.get("decode.tokens", (1, 1), torch.long, device, zero=True)
        self.input_pos = workspace.get("decode.input_pos", (1,), torch.long, device, zero=True)
        # One warm-up stream per engine, not per slot: cuBLAS keeps a 32 MiB workspace per stream (measured).
        side = warmup_stream
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(WARMUP_RUNS):
                self.runner(self.tokens, self.input_pos)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=pool, capture_error_mode="relaxed"):
            self.output = self.runner(self.tokens, self.input_pos)
        self.state.zero_()  # warm-up and capture wrote into the state: start clean
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - t0
        self.device_bytes = free_before - torch.cuda.mem_get_info(device)[0]  # state + runner + graph, device-level

    @property
    def overhead_bytes(self) -> int:
        """What the slot costs beyond its state: the runner's kernels and the graph."""
        return self.device_bytes - self.state.nbytes

    def replay(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Run one decode step; the returned logits buffer is overwritten by this slot's next replay."""
        self.tokens.copy_(tokens)
        self.input_pos.copy_(input_pos)
        self.graph.replay()
        return self.output

    def release(self) -> None:
        self.graph.reset()
        self.runner.close()
        self.state.release()
        self.output = None
