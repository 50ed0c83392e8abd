"""Qwen3.5 MoE's routed experts in a decode step, grouped by expert (`moe_routed`): each chosen expert's weights are
read once for all the rows that chose it (vLLM's fused_moe idea), where the eager step (`models.qwen3_5.Experts.routed`:
gathers feeding Inductor's fused products) reads an expert once per row that chose it.

The step's (token, slot) pairs are sorted by expert on the device (static shapes: a run per distinct expert, at most
N k runs, the empty ones exit at once); one kernel per run, tile of the hidden width and block of 16 of the run's
pairs computes silu(x W_gate^T) * (x W_up^T) for its pairs with the expert's gate/up rows read once a block, a
second per run, tile of the model width and block multiplies by W_down. The tiles do not depend on N (a dynamic dim
of an exported decode graph: one compiled kernel serves every batch size) and a row's bits do not depend on the rows
beside it; the routing weights and the sum over a token's k experts are torch ops (the
same order for every row, so no atomics). The rounding points are the eager step's. Float (bf16) experts only.
`ENABLED` stays False: against the eager step (H200, one 35B-A3B layer, `benchmarks/moe_decode_cuda.py`,
benchmarks/results/moe_decode_h200.json) it is 0.45x at 1 session (8 experts: too few programs for the GPU), 0.92x
at 4, 1.26x at 16 and 2.35x at 64 (timed with a run's pairs in one block of up to 64 rows, which an exported graph
could not take: its rows were sized by N at trace time; the 16-pair blocks are not yet timed), and one decode graph
serves every batch size.
The op is defined in `ops`; the kernels' source is `moe_triton`, imported when they are first launched.
"""

from __future__ import annotations

import torch

# Whether Experts.routed takes these kernels on CUDA (off: slower than the eager step below 16 rows)
ENABLED = False
BM = 16  # pairs of one run (one expert) a program multiplies: the MMA's rows


def runs(idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The pairs of ``idx`` [N, k] (expert ids) sorted by expert: (order [P]: pair ids, run_start, run_count,
    run_expert [P]: per run of one expert, runs past the last with count 0). Static shapes, device ops only."""
    flat = idx.reshape(-1)
    p = flat.numel()
    sorted_e, order = torch.sort(flat, stable=True)
    first = torch.ones_like(sorted_e, dtype=torch.bool)
    first[1:] = sorted_e[1:] != sorted_e[:-1]
    run = first.to(torch.int64).cumsum(0) - 1
    pos = torch.arange(p, device=idx.device)
    start = torch.full((p,), p, dtype=torch.int64, device=idx.device).scatter_reduce(0, run, pos, "amin")
    count = torch.zeros(p, dtype=torch.int64, device=idx.device).scatter_add(0, run, torch.ones_like(pos))
    expert = torch.zeros(p, dtype=torch.int64, device=idx.device).scatter_reduce(0, run, sorted_e.to(torch.int64),
                                                                                  "amax")
    return order, start, count, expert


def launch_moe_routed(x: torch.Tensor, idx: torch.Tensor, top: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor, wrap: bool = True, hidden_tile: int | None = None) -> torch.Tensor:
    """x [N, D] through each row's k experts ``idx`` [N, k] weighted by ``top`` [N, k]: gate_up [E, 2 I, D] and
    down [E, D, I] (contiguous); returns [N, D] in x's dtype. ``wrap=False`` launches the kernels directly (Triton's
    interpreter, outside any trace). ``hidden_tile``: the hidden width a gate/up program takes (a power of two from
    16; default up to 64): fewer, longer programs against more programs for few rows (a benchmark's sweep)."""
    from torch.library import wrap_triton

    n, d = x.shape
    k = idx.shape[1]
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    if gate_up.shape[2] != d or down.shape != (e, d, inter) or top.shape != idx.shape:
        raise ValueError(f"moe_routed: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down "
                         f"{tuple(down.shape)}, idx {tuple(idx.shape)}, top {tuple(top.shape)} do not match")
    from .moe_triton import moe_down_kernel, moe_gate_up_kernel  # here, past the checks: it imports Triton

    x = x if x.stride(-1) == 1 else x.contiguous()
    order, start, count, expert = runs(idx)
    p = n * k
    # a run holds at most N pairs (a token takes an expert once), in blocks of BM: the tiles do not depend on N, so
    # one compiled kernel serves every batch size of an exported graph (N is a dynamic dim there)
    blocks = (n + BM - 1) // BM
    h = torch.empty((p, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((p, d), dtype=x.dtype, device=x.device)
    up_k, down_k = (wrap_triton(moe_gate_up_kernel), wrap_triton(moe_down_kernel)) if wrap else \
        (moe_gate_up_kernel, moe_down_kernel)
    width = min(64, max(16, 1 << (inter - 1).bit_length()))
    bi = hidden_tile or width
    up_k[(p, -(-inter // bi), blocks)](x, gate_up, order, start, count, expert, h, x.stride(0), gate_up.stride(0),
                                       h.stride(0), D=d, INTER=inter, TOPK=k, BM=BM, BI=bi, BD=64, num_warps=4)
    bo = 64
    down_k[(p, -(-d // bo), blocks)](h, down, order, start, count, expert, y, h.stride(0), down.stride(0),
                                     y.stride(0), D=d, INTER=inter, TOPK=k, BM=BM, BO=bo, BI=width, num_warps=4)
    return (y.view(n, k, d) * top[..., None]).sum(1)
