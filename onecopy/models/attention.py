"""Attention over a state pool: every session's KV lives in one row of a pool tensor [P, H, S, D].

The exported methods get the pool and the rows they work on as inputs. These helpers write new
K/V only into those rows and read them without materialising a per-row copy of the cache:

- `write_rows` scatters new K/V into (row, position) slots in place (index_put on the pool);
- `pooled_attention` (decode: one query per row) is written as mul + sum reductions so that
  Inductor fuses the pool gather into the reduction kernels: no [B, H, S, D] gather is ever
  materialised (checked in tests on the generated code);
- `prefill_attention` (prefill chunks, one per session, of equal length): on CUDA a Triton
  flash-attention kernel reads the rows in place, causal by position; elsewhere `read_rows` copies the
  filled prefixes for SDPA.

Paged KV (``Step.table`` given): the pools are [NB, H, BS, D], blocks of BS positions, and a session's
position p lives in block ``table[row, p // BS]`` at offset ``p % BS``. Sessions that share a prompt
point their tables at the same blocks (`runtime.kv_manager`); the helpers below then address through the
table (`write_paged`, `gather_paged`) and the CUDA kernels read it in place.

8-bit KV (`kv_quant`, paged only): the pools hold int8 or fp8 values and two more pools [NB, H, BS]
their float32 scales, one per position and head; writes quantize, reads dequantize (on CUDA inside
the kernels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import kernels
from . import invariant, kv_quant


@dataclass
class KVCache:
    """One layer's KV cache: the K and V pools and, for an 8-bit cache, their scale pools [NB, H, BS]."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    native: bool = True  # an 8-bit cache's CUDA decode: the CUDA C++ kernel where it serves (`kernels.native`)

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


@dataclass
class Step:
    """What one method call works on: the pool rows, the positions written, and the kind of call."""

    rows: torch.Tensor  # decode: [B], one per session; prefill: [N], one per chunk (one chunk: [1])
    input_pos: torch.Tensor  # decode: [B]; prefill: [N, T] (one chunk: [T] too)
    decode: bool
    context: torch.Tensor | None = None  # prefill, when given: arange(the largest last position + 1)
    table: torch.Tensor | None = None  # paged KV: the block table [P, NBMAX] (rows index it)


def attend_pooled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
    """Write the new K/V into the step's rows at its positions, then attend; q, k, v, result: [N, T, H, D].

    Decode (T = 1, N sessions): each row's filled prefix, through its new position. Prefill: each of N
    equal-length chunks (input_pos [N, T]; or one chunk, input_pos [T]) causally against its row (only the
    filled prefix when ``step.context`` is given).
    """
    if step.table is not None:
        return attend_paged(q, k, v, step, cache)
    k_pool, v_pool = cache.k, cache.v
    if step.decode:
        write_rows(k_pool, step.rows, step.input_pos, k[:, 0])
        write_rows(v_pool, step.rows, step.input_pos, v[:, 0])
        return pooled_attention(q[:, 0], k_pool, v_pool, step.rows, step.input_pos + 1)[:, None]
    positions = chunk_positions(step)
    rows = token_rows(step.rows, positions)
    write_rows(k_pool, rows, positions.reshape(-1), k.flatten(0, 1))
    write_rows(v_pool, rows, positions.reshape(-1), v.flatten(0, 1))
    return prefill_attention(q, k_pool, v_pool, step.rows, positions, step.context)


def chunk_positions(step: Step) -> torch.Tensor:
    """A prefill step's positions as [N, T] (one chunk's [T], the Qwen3.5 prefill's form, as [1, T])."""
    return step.input_pos if step.input_pos.dim() == 2 else step.input_pos[None]


def token_rows(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each token's row, [N T] in the order of the flattened tokens, for chunks at ``positions`` [N, T]."""
    return rows[:, None].expand(positions.shape).reshape(-1)


def write_rows(pool: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """pool[rows[i], :, positions[i]] = values[i] for each i (values: [N, H, D]; rows broadcast to N)."""
    pool[rows, :, positions] = values


def read_rows(pool: torch.Tensor, rows: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """Pool rows ``rows`` [N], [N, H, S, D] (or their first ``length`` positions), for prefill attention.

    A copy of the rows per layer and call (small next to the chunks' matmuls). A view through
    ``row.item()`` exports on CPU but torch 2.11's AOTI CUDA wrapper emits an undeclared symbol
    for its bound check (measured on the H200).
    """
    if length is not None:
        pool = pool[:, :, :length]
    return pool.index_select(0, rows)


def pooled_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                     lengths: torch.Tensor | None) -> torch.Tensor:
    """One query per row against that row's first ``lengths[b]`` cached positions (all when None).

    q: [B, Hq, D]; pools: [P, Hkv, S, D] with Hq a multiple of Hkv (grouped-query attention);
    rows, lengths: [B] int64. Returns [B, Hq, D] in q's dtype. Scores and softmax run in fp32.
    On CUDA a Triton kernel reads only the filled prefix of each row (`kernels.decode_attention`).
    """
    if q.is_cuda and kernels.available():
        if lengths is None:
            lengths = torch.full_like(rows, k_pool.shape[2])
        return kernels.decode_attention(q, k_pool, v_pool, rows, lengths, invariant.active())
    return pooled_attention_torch(q, k_pool, v_pool, rows, lengths)


def pooled_attention_torch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                           lengths: torch.Tensor | None) -> torch.Tensor:
    """`pooled_attention` in plain torch ops (the CPU path; every cache position is read, masked)."""
    b, hq, d = q.shape
    hkv, s = k_pool.shape[1], k_pool.shape[2]
    g = hq // hkv
    qg = q.view(b, hkv, g, 1, d).float()
    k = k_pool[rows].unsqueeze(2)  # [B, Hkv, 1, S, D]: a gather that Inductor fuses into the sum below
    scores = (qg * k.float()).sum(-1) * (1.0 / math.sqrt(d))  # [B, Hkv, g, S]
    if lengths is not None:
        valid = torch.arange(s, device=q.device)[None, :] < lengths[:, None]  # [B, S]
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = scores.softmax(-1)
    v = v_pool[rows].unsqueeze(2)  # [B, Hkv, 1, S, D]
    out = (p.unsqueeze(-1) * v.float()).sum(-2)  # [B, Hkv, g, D]
    return out.reshape(b, hq, d).to(q.dtype)


def prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor,
                      positions: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
    """Chunks' queries (q: [N, T, Hq, D] at ``positions`` [N, T]) against pool rows ``rows`` [N], each
    causal; -> [N, T, Hq, D]. One chunk: q [T, Hq, D] at positions [T] against rows[0]; -> [T, Hq, D].

    The chunks' own K/V must already be in the rows. On CUDA a Triton flash-attention kernel reads the
    rows in place (`kernels.prefill_attention`); elsewhere `chunk_attention` over a copy of the filled
    prefixes (``context``: arange of the longest one's length, or the whole row when None).
    """
    if q.is_cuda and kernels.available():
        return kernels.prefill_attention(q, k_pool, v_pool, rows, positions)
    n_ctx = context.shape[0] if context is not None else None
    one = q.dim() == 3
    q, positions = (q[None], positions[None]) if one else (q, positions)
    y = chunk_attention(q.transpose(1, 2), read_rows(k_pool, rows, n_ctx), read_rows(v_pool, rows, n_ctx),
                        positions, context).transpose(1, 2)
    return y[0] if one else y


def chunk_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, positions: torch.Tensor,
                    context: torch.Tensor | None = None) -> torch.Tensor:
    """Chunks' queries (q: [N, Hq, T, D] at ``positions`` [N, T]) against their rows' caches [N, Hkv, S, D],
    causal; -> [N, Hq, T, D].

    ``context`` (arange of the longest filled length, when given) equals the keys the rows hold: k_rows
    and v_rows are then that long, not max_seq_len. A shorter chunk's keys past its positions are masked.
    """
    keys = context if context is not None else torch.arange(k_rows.shape[2], device=q.device)
    mask = positions[:, None, :, None] >= keys  # [N, 1, T, S]
    return F.scaled_dot_product_attention(q, k_rows, v_rows, attn_mask=mask, enable_gqa=q.shape[1] != k_rows.shape[1])


# -- paged KV ----------------------------------------------------------------------------------------
def attend_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
    """`attend_pooled` over block pools [NB, Hkv, BS, D] addressed through ``step.table``."""
    table = step.table
    on_cuda = q.is_cuda and kernels.available()
    if step.decode:
        write_paged(cache.k, table, step.rows, step.input_pos, k[:, 0], cache.k_scale)
        write_paged(cache.v, table, step.rows, step.input_pos, v[:, 0], cache.v_scale)
        lengths = step.input_pos + 1
        if on_cuda and cache.quantized:
            return kernels.paged_decode_attention_q8(q[:, 0], cache.k, cache.v, cache.k_scale, cache.v_scale, table,
                                                     step.rows, lengths, invariant.active(), cache.native)[:, None]
        if on_cuda:
            return kernels.paged_decode_attention(q[:, 0], cache.k, cache.v, table, step.rows, lengths,
                                                  invariant.active())[:, None]
        return paged_attention_torch(q[:, 0], cache, table, step.rows, lengths)[:, None]
    positions = chunk_positions(step)
    rows = token_rows(step.rows, positions)
    write_paged(cache.k, table, rows, positions.reshape(-1), k.flatten(0, 1), cache.k_scale)
    write_paged(cache.v, table, rows, positions.reshape(-1), v.flatten(0, 1), cache.v_scale)
    if on_cuda and cache.quantized:
        return kernels.paged_prefill_attention_q8(q, cache.k, cache.v, cache.k_scale, cache.v_scale, table,
                                                  step.rows, positions)
    if on_cuda:
        return kernels.paged_prefill_attention(q, cache.k, cache.v, table, step.rows, positions)
    keys = step.context if step.context is not None else torch.arange(table.shape[1] * cache.k.shape[2], device=q.device)
    k_rows = gather_paged(cache.k, table, step.rows, keys)  # [N, H, S, D]
    v_rows = gather_paged(cache.v, table, step.rows, keys)
    if cache.quantized:  # [N, H, S, D] values times [N, H, S] scales, in q's dtype for SDPA
        k_rows = kv_quant.dequantize(k_rows, gather_paged(cache.k_scale[..., None], table, step.rows, keys)[..., 0])
        v_rows = kv_quant.dequantize(v_rows, gather_paged(cache.v_scale[..., None], table, step.rows, keys)[..., 0])
        k_rows, v_rows = k_rows.to(q.dtype), v_rows.to(q.dtype)
    return chunk_attention(q.transpose(1, 2), k_rows, v_rows, positions, step.context).transpose(1, 2)


def write_paged(pool: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                values: torch.Tensor, scales: torch.Tensor | None = None) -> None:
    """pool[table[rows[i], p // BS], :, p % BS] = values[i] with p = positions[i] (values: [N, H, D]);
    with ``scales`` (an 8-bit pool's [NB, H, BS]) the values are quantized and their scales written too."""
    bs = pool.shape[2]
    blocks, offsets = table[rows, positions // bs], positions % bs
    if scales is not None:
        values, scale = kv_quant.quantize(values, pool.dtype)
        scales[blocks, :, offsets] = scale
    pool[blocks, :, offsets] = values


def gather_paged(pool: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Positions ``positions`` [S] of each of ``rows`` [B] through the table: [B, H, S, D] (a gather that
    Inductor fuses into the reductions reading it)."""
    bs = pool.shape[2]
    blocks = table[rows][:, positions // bs]  # [B, S]
    return pool[blocks, :, positions % bs].permute(0, 2, 1, 3)  # [B, S, H, D] -> [B, H, S, D]


def paged_attention_torch(q: torch.Tensor, cache: KVCache, table: torch.Tensor, rows: torch.Tensor,
                          lengths: torch.Tensor) -> torch.Tensor:
    """`pooled_attention_torch` over block pools: each row's first ``lengths[b]`` positions, in fp32.

    Block by block ([B, NBMAX, Hkv, BS, D] views of the pools through the table), so that Inductor
    fuses the gather into the reductions as it does for rows: no copy of the cache is materialised.
    An 8-bit cache's values are dequantized as they are read (the same fused gather).
    """
    k_pool, v_pool = cache.k, cache.v
    b, hq, d = q.shape
    hkv, bs = k_pool.shape[1], k_pool.shape[2]
    nb = table.shape[1]
    g = hq // hkv
    blocks = table[rows]  # [B, NBMAX]
    qg = q.view(b, 1, hkv, g, 1, d).float()
    k = k_pool[blocks].float()  # [B, NBMAX, Hkv, BS, D]
    v = v_pool[blocks].float()
    if cache.quantized:
        k, v = kv_quant.dequantize(k, cache.k_scale[blocks]), kv_quant.dequantize(v, cache.v_scale[blocks])
    k = k.unsqueeze(3)  # [B, NBMAX, Hkv, 1, BS, D]
    scores = (qg * k).sum(-1) * (1.0 / math.sqrt(d))  # [B, NBMAX, Hkv, g, BS]
    valid = torch.arange(nb * bs, device=q.device).view(nb, bs)[None] < lengths[:, None, None]  # [B, NBMAX, BS]
    scores = scores.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    p = scores.permute(0, 2, 3, 1, 4).reshape(b, hkv, g, nb * bs).softmax(-1).view(b, hkv, g, nb, bs)
    v = v.permute(0, 2, 1, 3, 4).unsqueeze(2)  # [B, Hkv, 1, NBMAX, BS, D]
    out = (p.unsqueeze(-1) * v).sum((-3, -2))  # [B, Hkv, g, D]
    return out.reshape(b, hq, d).to(q.dtype)
