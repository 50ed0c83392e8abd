"""Qwen3.5's gated DeltaNet token mixer (linear attention with a recurrent state per session).

Its per-session state is a causal-conv window (``conv_state`` [conv_dim, kernel], the model dtype,
as transformers' cache keeps it) and a recurrent matrix per value head (``recurrent_state``
[v_heads, k_head_dim, v_head_dim], always fp32, as transformers keeps it), rows of pools the runtime
passes in: ``decode`` runs one recurrent step per session (rows gathered, new state written back
with ``index_copy_``), ``prefill`` runs the chunked gated delta rule over a session's chunk of T
tokens starting from its row. T is dynamic in export, so the chunking is a fixed number n of chunks
(`qwen3_5.Qwen35.prefill_chunks`: a static trip count) of ``ceil(T / n) + 1`` slots each, the tail
padded with tokens that leave the state untouched (zero key, beta and log decay); the within-chunk
work (UT transform, one batched triangular solve) is batched over the chunks, only the state
hand-over between chunks is a loop. On CUDA that loop is one kernel (`kernels.deltanet_chunk_scan`) and
the chunks are transformers' (``linear_chunk_size`` slots, their count a run-time value), so the prefill graph no
longer grows with the chunk count. A call starting at position 0 starts from a zero state whatever the row holds.
The math follows transformers' ``modeling_qwen3_5``. On CUDA the decode step between the input and output
projections is one Triton kernel (`kernels.deltanet`), the same math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from . import layers
from .attention import Step
from .qwen3_5_config import Qwen35Config


class GatedRMSNorm(layers.RMSNorm):
    """The DeltaNet output norm: Llama's ``w * norm(x)`` (plain weight) times ``silu(gate)`` in fp32."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (super().forward(x) * F.silu(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, n_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one session's T tokens, in ``n_chunks`` chunks of ceil(T / n_chunks) + 1 slots.

    q, k: [H, T, dk] (l2-normalised), v: [H, T, dv], g (log decay), beta: [H, T], state: [H, dk, dv];
    all fp32. Returns the output [H, T, dv] and the final state. Same math as transformers'
    ``torch_chunk_gated_delta_rule`` (UT transform per chunk, state passed chunk to chunk); the
    tail padding (zero q, k, v, beta and log decay) leaves the state exactly as it is.
    """
    t = k.shape[1]
    c = (t + n_chunks - 1) // n_chunks + 1  # one spare slot per chunk: c >= 2 provably (export would guard on c == 1)
    out, state = scan_chunks(*chunk_terms(q, k, v, g, beta, n_chunks, c), state)
    # the T real positions (a slice would need t <= n * c proven symbolically)
    return out.reshape(out.shape[0], -1, out.shape[-1]).index_select(1, torch.arange(t, device=out.device)), state


def chunk_gated_delta_rule_scanned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                   beta: torch.Tensor, state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_gated_delta_rule` in chunks of ``chunk`` slots (transformers' chunking: their count a run-time value)
    with the chunk-to-chunk recurrence in one CUDA kernel (`kernels.deltanet_chunk_scan`): a graph holds one launch
    a layer for any prompt length, where the loop in torch ops is unrolled once per chunk (a 40-layer model's prefill
    graph: thousands of products, most of its export time)."""
    t = k.shape[1]
    # ceil(t / chunk) + 1 as one floor division: n >= 2 provably (export would guard on n == 1), and n * chunk splits
    # back into n chunks provably (with "+ 1" outside, sympy cannot show n divides the padded length)
    n = (t + 2 * chunk - 1) // chunk
    out, state = kernels.deltanet_chunk_scan(*chunk_terms(q, k, v, g, beta, n, chunk), state)
    return out.reshape(out.shape[0], -1, out.shape[-1]).index_select(1, torch.arange(t, device=out.device)), state


def chunk_terms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, n: int,
                c: int) -> tuple[torch.Tensor, ...]:
    """The per-chunk terms of the chunked rule (``n`` chunks of ``c`` slots, the tail zero-padded), batched over the
    chunks: (new_values [H, n, c, dv], k_cumdecay, q_dec, k_dec [H, n, c, dk], intra [H, n, c, c], chunk_decay
    [H, n]); what is left is the state's hand-over from chunk to chunk (`scan_chunks`)."""
    h, t, dk = k.shape
    q = q * dk ** -0.5
    q, k, v = (F.pad(x, (0, 0, 0, n * c - t)).view(h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = (F.pad(x, (0, n * c - t)).view(h, n, c) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    decay = g.cumsum(-1)  # [H, n, c]: log decay from the chunk's start to each position
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise  # (I + strictly lower part) is the UT system
    intra = (q @ k.transpose(-1, -2)) * pairwise
    rhs = torch.cat([v_beta, k_beta * decay.exp()[..., None]], dim=-1)  # both right-hand sides in one solve
    new_values, k_cumdecay = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True).split(
        [v_beta.shape[-1], dk], dim=-1)
    q_dec = q * decay.exp()[..., None]
    k_dec = k * (decay[..., -1:] - decay).exp()[..., None]
    return new_values, k_cumdecay, q_dec, k_dec, intra, decay[..., -1].exp()


def scan_chunks(new_values: torch.Tensor, k_cumdecay: torch.Tensor, q_dec: torch.Tensor, k_dec: torch.Tensor,
                intra: torch.Tensor, chunk_decay: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The state passed from chunk to chunk (a static trip count: the chunk count): the output [H, n, c, dv] and
    the state after the last chunk."""
    outs = []
    for i in range(new_values.shape[1]):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        outs.append(q_dec[:, i] @ state + intra[:, i] @ v_new)
        state = state * chunk_decay[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new
    return torch.stack(outs, 1), state


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer; q/k/v, z, b and a projections fused into one ``in_proj``."""

    def __init__(self, cfg: Qwen35Config) -> None:
        super().__init__()
        self.nk, self.nv = cfg.linear_n_k_heads, cfg.linear_n_v_heads
        self.dk, self.dv = cfg.linear_k_head_dim, cfg.linear_v_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel
        self.in_proj = nn.Linear(cfg.dim, self.conv_dim + self.value_dim + 2 * self.nv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.dim, bias=False)
        # the CUDA prefill's chunk scan kernel takes power-of-two tiles of 16 or more
        self.chunk = cfg.linear_chunk_size
        self.chunk_scan = all(d >= 16 and d & (d - 1) == 0 for d in (self.chunk, self.dk, self.dv))

    def forward(self, x: torch.Tensor, step: Step, conv_pool: torch.Tensor, rec_pool: torch.Tensor,
                n_chunks: int) -> torch.Tensor:
        """x: [N, T, dim] (decode: N sessions, T = 1; prefill: N = 1)."""
        n, t, _ = x.shape
        if step.decode and x.is_cuda and kernels.available():  # the whole step between the projections: one kernel
            out = kernels.deltanet_decode(self.in_proj(x)[:, 0], conv_pool, self.conv1d.weight, rec_pool, self.A_log,
                                          self.dt_bias, self.norm.weight, step.rows, step.input_pos, self.nk,
                                          self.norm.eps)
            return self.out_proj(out[:, None])
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.nv, self.nv], dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [N, T, nv] fp32
        fresh = (step.input_pos == 0) if step.decode else (step.input_pos[:1] == 0)  # [N]: start from zero
        conv_state = conv_pool.index_select(0, step.rows)  # [N, conv_dim, kernel]
        conv_state = torch.where(fresh[:, None, None], torch.zeros_like(conv_state), conv_state)
        window = torch.cat([conv_state, mixed.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # [N, C, kernel + T]
        conv_pool.index_copy_(0, step.rows, window[..., t:])  # the last `kernel` inputs
        w = self.conv1d.weight  # [C, 1, kernel]
        if step.decode:
            conv = (window[..., 1:] * w[:, 0]).sum(-1, keepdim=True)  # [N, C, 1]
        else:
            conv = F.conv1d(window, w, groups=self.conv_dim)[..., 1:]  # [1, C, T]
        mixed = F.silu(conv).to(x.dtype).transpose(1, 2)  # [N, T, C]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.nv // self.nk
        q = l2norm(q.reshape(n, t, self.nk, self.dk).float()).repeat_interleave(rep, dim=2)
        k = l2norm(k.reshape(n, t, self.nk, self.dk).float()).repeat_interleave(rep, dim=2)
        v = v.reshape(n, t, self.nv, self.dv).float()
        state = rec_pool.index_select(0, step.rows)  # [N, nv, dk, dv] fp32
        state = torch.where(fresh[:, None, None, None], torch.zeros_like(state), state)
        if step.decode:  # one recurrent step per session (transformers' torch_recurrent_gated_delta_rule)
            q, k, v = q[:, 0] / self.dk ** 0.5, k[:, 0], v[:, 0]  # [N, nv, d]
            state = state * g[:, 0].exp()[..., None, None]
            kv_mem = (state * k[..., None]).sum(-2)
            delta = (v - kv_mem) * beta[:, 0].float()[..., None]
            state = state + k[..., None] * delta[..., None, :]
            out = (state * q[..., None]).sum(-2)[:, None]  # [N, 1, nv, dv]
        else:
            args = (q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), g[0].transpose(0, 1),
                    beta[0].float().transpose(0, 1), state[0])
            if x.is_cuda and kernels.available() and self.chunk_scan:  # the chunk recurrence in one kernel
                out, state = chunk_gated_delta_rule_scanned(*args, self.chunk)
            else:
                out, state = chunk_gated_delta_rule(*args, n_chunks)
            out, state = out.transpose(0, 1)[None], state[None]
        rec_pool.index_copy_(0, step.rows, state.to(rec_pool.dtype))
        out = self.norm(out.to(x.dtype), z.reshape(n, t, self.nv, self.dv))
        return self.out_proj(out.reshape(n, t, self.value_dim))
