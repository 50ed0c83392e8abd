"""CUDA graphs of the batched decode: one capture per batch size (bucket), all in one memory pool.

Measured (docs/architecture.md, "Facts measured"): a loaded AOTI runner that was captured is replay-only, so each bucket owns
a runner, bound to the engine's shared weights. Every graph reads the same static inputs (tokens,
positions, rows) and the same state pools, whose addresses never change, so any session's row
can ride in any graph: a step pads to the next bucket and points the padding at the scratch row.
The graphs share one static output: the largest graph's; each smaller one copies its output into that
output's first rows inside the graph and frees its own, so a bucket costs no output memory of its own (a step
reads one graph's output before the next replays). Fine buckets past a few hundred rows are then cheap, and
that is where padding costs in proportion (the GEMMs are compute-bound there).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..bundle import MethodSpec
from .method import Method
from .weights import WeightStore

WARMUP_RUNS = 2
log = logging.getLogger(__name__)


class DecodeGraphs:
    """Captured decode graphs by batch size; ``inputs(B)`` gives the static inputs a graph of B reads."""

    def __init__(self, spec: MethodSpec, package: Path, device: torch.device, store: WeightStore,
                 buckets: list[int], inputs, warmup_stream: torch.cuda.Stream) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        self.mempool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, tuple[Method, torch.cuda.CUDAGraph]] = {}
        self._out: list[torch.Tensor] = []  # the largest graph's outputs; a graph of b rows writes their first b
        self._single = True
        try:
            for b in sorted(buckets, reverse=True):  # largest first: smaller graphs reuse its pool blocks
                runner = Method(spec, package, device)
                runner.bind_weights(store)
                args = inputs(b)
                # One warm-up stream per engine: cuBLAS keeps a workspace per stream it ran on (measured).
                warmup_stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(warmup_stream), torch.inference_mode():
                    for _ in range(WARMUP_RUNS):
                        runner(*args)
                torch.cuda.current_stream(device).wait_stream(warmup_stream)
                graph = torch.cuda.CUDAGraph()
                with torch.inference_mode(), torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="relaxed"):
                    out = runner(*args)
                    outs = [out] if isinstance(out, torch.Tensor) else list(out)
                    if not self._out:
                        self._out, self._single = outs, isinstance(out, torch.Tensor)
                    else:
                        for static, o in zip(self._out, outs, strict=True):
                            static[:b].copy_(o)
                    del out, outs  # a smaller graph's own outputs go back to the pool for the next capture
                self._graphs[b] = (runner, graph)
        except BaseException:
            self.release()
            raise
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - t0
        self.device_bytes = free_before - torch.cuda.mem_get_info(device)[0]  # runners + graphs, device-level
        log.info("captured decode graphs for batch sizes %s in %.1f s (%.0f MiB)", sorted(buckets),
                 self.capture_seconds, self.device_bytes / 2**20)

    @property
    def buckets(self) -> list[int]:
        return sorted(self._graphs)

    def replay(self, batch: int) -> torch.Tensor | list[torch.Tensor]:
        """Run the graph of ``batch`` rows on what the static inputs hold now; returns its output: views of the
        shared static output's first ``batch`` rows, valid until the next replay."""
        _, graph = self._graphs[batch]
        graph.replay()
        views = [o[:batch] for o in self._out]
        return views[0] if self._single else views

    def release(self) -> None:
        for runner, graph in self._graphs.values():
            graph.reset()
            runner.close()
        self._graphs.clear()
        self._out = []
