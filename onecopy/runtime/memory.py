"""Memory: how many session rows and KV blocks fit, what an Engine holds, and what the device reports.

AOTInductor allocates with raw cudaMalloc, so torch's allocator statistics miss it: on CUDA the
device figure comes from cudaMemGetInfo; on CPU it is the process's resident set.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..bundle import Manifest, parse_dtype
from ..errors import SessionCapacityError

if TYPE_CHECKING:
    from .method import Method
    from .runner import ModelRunner
    from .scheduler import Scheduler
    from .weights import WeightStore

CPU_DEFAULT_SESSIONS = 8  # pool rows on CPU unless max_sessions or memory_budget say otherwise
CUDA_MAX_SESSIONS = 256  # cap on the rows sized from free GPU memory (and on the largest decode graph)


def device_used(device: torch.device, sync: bool = True) -> int:
    """Bytes in use on the device as the device sees it (CUDA), or this process's RSS (CPU).

    ``sync=False`` reads without waiting for queued work (metrics scraped while the device runs).
    """
    if device.type == "cuda":
        if sync:
            torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def available_bytes(device: torch.device) -> int:
    """Free device memory (CUDA), or the host's MemAvailable (CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def gpu_reserve(total_bytes: int) -> int:
    """GPU memory kept free for activations, graphs and workspaces when sizing the state pool."""
    return max(512 * 2**20, total_bytes // 20)


def default_reserve(device: torch.device) -> int:
    if device.type == "cuda":
        return gpu_reserve(torch.cuda.get_device_properties(device).total_memory)
    return 1 << 30


def gpu_room(device: torch.device, memory_fraction: float, reserve: int) -> int:
    """Bytes the state may take on a GPU: ``memory_fraction`` of it after what is in use and ``reserve``."""
    free, total = torch.cuda.mem_get_info(device)
    return min(free, int(total * memory_fraction) - (total - free)) - reserve


def row_bytes(manifest: Manifest) -> tuple[int, int]:
    """(bytes of one session's row outside the paged KV, bytes of a session at max_seq_len).

    The sampler keeps up to three bool [rows, vocab] tables and a row has a block table: both count
    with the row."""
    paged = set(manifest.paged_state)
    fixed = sum(s.nbytes for k, s in manifest.state.items() if k not in paged) + 3 * int(
        manifest.config["vocab_size"]) + 8 * manifest.table_width
    return fixed, fixed + manifest.table_width * sum(manifest.state[f].nbytes for f in paged)


def size_pool(row_bytes: int, device: torch.device, *, max_sessions: int | None, memory_budget: int | None,
              memory_fraction: float, reserve: int) -> tuple[int, str]:
    """How many session rows the pool gets, and why (said in the memory report).

    ``max_sessions`` is taken as asked (refused if it does not fit; a paged bundle's rows are sized by
    `size_paged_sessions` instead); otherwise CUDA takes
    ``memory_fraction`` of the device's memory minus what is in use and the reserve (like vLLM's
    gpu_memory_utilization), up to CUDA_MAX_SESSIONS, and CPU takes CPU_DEFAULT_SESSIONS.
    ``memory_budget`` bounds the pool's bytes in every case.
    """
    per = row_bytes or 1
    room, where = _room(device, memory_budget, memory_fraction, reserve)
    fits = max(room, 0) // per - 1  # one row is scratch
    if max_sessions is not None:
        if max_sessions > fits:
            raise SessionCapacityError(
                f"max_sessions={max_sessions} needs {(max_sessions + 1) * per} bytes of state pool ({per} per session "
                f"plus a scratch row) but {where} leaves room for {max(fits, 0)}; ask for fewer sessions, export with a "
                "smaller --max-seq-len, or free memory")
        return max_sessions, f"max_sessions={max_sessions}"
    if fits < 1:
        raise SessionCapacityError(f"no session fits: one needs {2 * per} bytes of state pool (its row and a scratch row) "
                                   f"and {where} leaves {max(room, 0)}; export with a smaller --max-seq-len or free memory")
    if memory_budget is not None:
        return fits, f"{fits} rows fit in {where}"
    if device.type == "cuda":
        rows = min(fits, CUDA_MAX_SESSIONS)
        why = f"capped at {CUDA_MAX_SESSIONS}; " if rows < fits else ""
        return rows, f"{rows} rows from free GPU memory ({why}{fits} fit in {where})"
    rows = min(fits, CPU_DEFAULT_SESSIONS)
    return rows, f"{rows} rows: the CPU default (pass max_sessions or memory_budget to change it)"


def size_paged_sessions(max_sessions: int, manifest: Manifest, fixed_row_bytes: int, device: torch.device, *,
                        kv_blocks: int | None, memory_budget: int | None, memory_fraction: float,
                        reserve: int) -> tuple[int, int, str]:
    """(rows, KV blocks, why) for a paged bundle loaded with an explicit ``max_sessions``: rows are cheap
    (each costs its state outside the paged KV), blocks are the capacity. The blocks are ``kv_blocks``, else
    as many as every row at max_seq_len would take or, if fewer fit, as many as the room left by the rows
    holds (at least one session at max_seq_len): requests then wait at admission for the blocks they need, as
    in vLLM and TensorRT-LLM, which run as many sequences as the blocks hold. SessionCapacityError when the
    rows alone, or the rows and ``kv_blocks``, do not fit."""
    block_bytes = sum(manifest.state[f].nbytes for f in manifest.paged_state)
    width = manifest.table_width
    room, where = _room(device, memory_budget, memory_fraction, reserve)
    rows_bytes = (max_sessions + 1) * fixed_row_bytes  # one row is scratch
    left = room - rows_bytes
    if kv_blocks is not None:
        if (kv_blocks + 1) * block_bytes > left:
            raise SessionCapacityError(
                f"max_sessions={max_sessions} and kv_blocks={kv_blocks} need {rows_bytes + (kv_blocks + 1) * block_bytes} "
                f"bytes of state ({fixed_row_bytes} per row, {block_bytes} per KV block, plus a scratch row and block) "
                f"but {where} leaves {max(room, 0)}; ask for fewer sessions or blocks, or free memory")
        return max_sessions, kv_blocks, f"max_sessions={max_sessions}; kv_blocks={kv_blocks}"
    blocks = min(max_sessions * width, left // block_bytes - 1)
    if blocks < width:
        raise SessionCapacityError(
            f"max_sessions={max_sessions} rows take {rows_bytes} bytes ({fixed_row_bytes} per row plus a scratch row) "
            f"and leave room for {max(blocks, 0)} KV blocks of {block_bytes} bytes in {where}, fewer than one session "
            f"at max_seq_len needs ({width}); ask for fewer sessions, export with a smaller --max-seq-len, or free memory")
    if blocks == max_sessions * width:
        return max_sessions, blocks, f"max_sessions={max_sessions}; {blocks} KV blocks: every row can reach max_seq_len"
    return max_sessions, blocks, (f"max_sessions={max_sessions}; {blocks} KV blocks ({blocks * manifest.kv_block_size} "
                                  f"positions) fit in {where}: requests wait for the blocks they need")


def _room(device: torch.device, memory_budget: int | None, memory_fraction: float, reserve: int) -> tuple[int, str]:
    """Bytes the state may take and where that figure comes from (`size_pool`'s rule)."""
    if device.type == "cuda":
        room = gpu_room(device, memory_fraction, reserve)
        where = f"{memory_fraction:.2f} of device memory after what is in use and a {reserve / 2**20:,.0f} MiB reserve"
    else:
        room = available_bytes(device) - reserve
        where = f"available host memory after a {reserve / 2**20:,.0f} MiB reserve"
    if memory_budget is not None:
        room, where = min(room, memory_budget), f"memory_budget={memory_budget} bytes"
    return room, where


def size_blocks(rows: int, why: str, manifest: Manifest, fixed_row_bytes: int, device: torch.device, *,
                kv_blocks: int | None, sized_by_user: bool, memory_fraction: float, reserve: int) -> tuple[int, int, str]:
    """(rows, KV blocks, why) for a paged bundle, from the rows `size_pool` gave at full length.

    By default every row can fill max_seq_len (``rows`` x the table width); on CUDA with nothing asked
    the blocks take the free memory instead, with CUDA_MAX_SESSIONS rows: sessions that share a prompt
    or stop early then fit beyond that count. ``kv_blocks`` sets the blocks itself.
    """
    block_bytes = sum(manifest.state[f].nbytes for f in manifest.paged_state)
    width = manifest.table_width
    if kv_blocks is not None:
        return rows, kv_blocks, f"{why}; kv_blocks={kv_blocks}"
    if device.type == "cuda" and not sized_by_user:
        room = gpu_room(device, memory_fraction, reserve)
        rows = CUDA_MAX_SESSIONS
        blocks = (room - (rows + 1) * fixed_row_bytes) // block_bytes - 1
        if blocks < width:
            raise SessionCapacityError(f"one session at max_seq_len needs {width} KV blocks of {block_bytes} bytes and "
                                       f"free GPU memory holds {max(blocks, 0)}; export with a smaller --max-seq-len")
        return rows, blocks, (f"{rows} rows, {blocks} KV blocks ({blocks * manifest.kv_block_size} positions) from "
                              f"{memory_fraction:.2f} of GPU memory after what is in use and the reserve")
    return rows, rows * width, f"{why}; {rows * width} KV blocks: every row can reach max_seq_len"


def _mib(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:,.1f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:,.1f} KiB"


@dataclass
class MemoryReport:
    """What one Engine holds. Printing it gives a table."""

    device: str
    unique_weight_bytes: int  # every weight FQN any method needs, counted once
    resident_weight_bytes: int  # weights really held: the store plus copies inside embedded packages
    duplicated_weight_bytes: int  # resident minus unique: 0 when every method shares the store
    state_bytes: int  # state rows of the open sessions
    sessions_open: int
    state_bytes_per_session: int  # one pool row
    device_used_bytes: int  # growth of device use since just before the Engine loaded (device-level)
    device_total_used_bytes: int  # device use now, whoever holds it
    capacity: int  # sessions that can still be opened (free pool rows)
    pool_rows: int = 0  # sessions the state pool holds (plus one scratch row)
    pool_bytes: int = 0  # the whole pool, allocated at load
    pool_sizing: str = ""  # why the pool has that many rows
    sampler_bytes: int = 0  # per-row sampling tables (repetition penalty, suppressed ids)
    graph_buckets: list[int] = field(default_factory=list)  # batch sizes with a captured decode graph
    graph_bytes: int = 0  # device bytes of the captured graphs and their runners (measured at capture)
    workspace_bytes: int = 0  # named static buffers
    deterministic: bool = False
    notes: list[str] = field(default_factory=list)
    # Paged KV (0 without): blocks of kv_block_size positions, by who references them.
    kv_block_size: int = 0
    kv_blocks: int = 0
    kv_dtype: str = ""  # the cache's storage (`Manifest.kv_dtype_description`): values' dtype, scales if 8-bit
    kv_block_bytes: int = 0  # one block of every layer's K and V (and scales)
    kv_shared_bytes: int = 0  # blocks two or more sessions read (a shared prompt: held once)
    kv_private_bytes: int = 0  # blocks one session reads
    kv_evictable_bytes: int = 0  # cached prefixes no session holds: reused by later prompts, evicted LRU first
    kv_free_bytes: int = 0
    kv_references: int = 0  # block references summed over sessions (what unshared KV would take, in blocks)
    prefix_cache: bool = False
    prefix_cached_tokens: int = 0  # prompt tokens taken from the cache instead of prefilled, since load
    kv_peak_used_blocks: int = 0  # the most blocks rows held at once, since load
    preemptions: int = 0  # running requests whose blocks were taken for others (resumed by recompute), since load
    recomputed_tokens: int = 0  # ids those requests put back in their rows
    # Tiers of the prefix cache (`kv_tiers`; 0 without): evicted blocks kept in host memory and on disk.
    kv_host_tier_bytes: int = 0  # host memory of the host tier's slots (pinned on CUDA)
    kv_host_tier_blocks: int = 0  # blocks the host tier holds now
    kv_disk_tier_blocks: int = 0  # blocks the disk tier holds now (files)
    kv_tier_saved: int = 0  # evicted blocks kept, since load
    kv_tier_restored: int = 0  # blocks loaded back from host or disk instead of prefilled, since load
    packed_weight_bytes: int = 0  # of the unique weights: the packed (quantized) layers' values, scales, mins
    packed_as_float_bytes: int = 0  # what those layers would take in the model dtype

    def __str__(self) -> str:
        buckets = ",".join(map(str, self.graph_buckets)) or "none"
        rows = [
            ("device", self.device),
            ("unique weights", _mib(self.unique_weight_bytes)),
            ("resident weights", _mib(self.resident_weight_bytes)),
            ("duplicated weights", _mib(self.duplicated_weight_bytes)),
            *([("packed weights (as float)", f"{_mib(self.packed_weight_bytes)} ({_mib(self.packed_as_float_bytes)})")]
              if self.packed_weight_bytes else []),
            ("state pool", f"{self.pool_rows} rows + scratch, {_mib(self.pool_bytes)}"),
            ("state per session", _mib(self.state_bytes_per_session)),
            *([("KV blocks", f"{self.kv_blocks} x {self.kv_block_size} positions"),
               ("KV block", f"{self.kv_block_bytes / 2**10:,.1f} KiB"),
               ("KV shared / private", f"{_mib(self.kv_shared_bytes)} / {_mib(self.kv_private_bytes)}"),
               ("KV cached (evictable)", _mib(self.kv_evictable_bytes)),
               ("KV free", _mib(self.kv_free_bytes)),
               ("KV blocks used at most", str(self.kv_peak_used_blocks)),
               ("preemptions (ids recomputed)", f"{self.preemptions} ({self.recomputed_tokens})")]
              if self.kv_blocks else []),
            *([("KV tiers: host / disk blocks", f"{self.kv_host_tier_blocks} / {self.kv_disk_tier_blocks}"),
               ("KV host tier", _mib(self.kv_host_tier_bytes)),
               ("KV tier saved / restored", f"{self.kv_tier_saved} / {self.kv_tier_restored}")]
              if self.kv_host_tier_bytes or self.kv_disk_tier_blocks or self.kv_tier_saved else []),
            ("sessions open", str(self.sessions_open)),
            ("sessions that still fit", str(self.capacity)),
            ("decode graphs (batch sizes)", buckets),
            ("graphs + runners", _mib(self.graph_bytes)),
            ("workspace + sampler", _mib(self.workspace_bytes + self.sampler_bytes)),
            ("device used by engine", _mib(self.device_used_bytes)),
            ("device used (total)", _mib(self.device_total_used_bytes)),
        ]
        w = max(len(k) for k, _ in rows)
        lines = [f"{k:<{w}}  {v:>14}" for k, v in rows] + [f"pool sizing: {self.pool_sizing}"]
        if self.kv_blocks:
            lines.append(f"kv dtype: {self.kv_dtype}")
            lines.append(f"prefix cache: {'on' if self.prefix_cache else 'off'}, {self.prefix_cached_tokens} prompt "
                         "tokens taken from it")
        if self.deterministic:
            lines.append("deterministic: the batch-invariant decode (a session's bits never depend on its neighbours)")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def engine_report(device: torch.device, manifest: Manifest, methods: "list[Method]", store: "WeightStore",
                  runner: "ModelRunner", scheduler: "Scheduler", *, sessions_open: int, baseline_used: int,
                  pool_sizing: str, state_bytes_per_session: int, prefix_cache: bool, deterministic: bool,
                  notes: list[str]) -> MemoryReport:
    """What one engine holds: weights counted once, the pool and KV blocks by who reads them, graphs,
    and the device-level figure next to the sums."""
    weights = manifest.weights
    needed = {f for m in methods for f in m.weight_fqns}
    unique = sum(weights[f].nbytes for f in needed)
    embedded = sum(weights[f].nbytes for m in methods if m.embeds_weights for f in m.weight_fqns)
    resident = store.nbytes + embedded
    if embedded:
        names = [m.name for m in methods if m.embeds_weights]
        notes = [f"methods {names} carry their own weights (fallback path): re-export to share one copy", *notes]
    used = device_used(device)
    graphs = runner.step.graphs if runner.step is not None else None
    kv, kv_manager = {}, scheduler.kv
    state_bytes = sessions_open * runner.pool.row_bytes
    if kv_manager is not None:
        use, block = kv_manager.usage(), runner.blocks.block_bytes
        kv = dict(kv_block_size=kv_manager.block_size, kv_blocks=kv_manager.blocks,
                  kv_dtype=manifest.kv_dtype_description(), kv_block_bytes=block,
                  kv_shared_bytes=use["shared"] * block, kv_private_bytes=use["private"] * block,
                  kv_evictable_bytes=use["cached"] * block, kv_free_bytes=use["free"] * block,
                  kv_references=use["references"], prefix_cache=prefix_cache,
                  prefix_cached_tokens=scheduler.stats.cached_tokens, kv_peak_used_blocks=kv_manager.peak_used,
                  preemptions=scheduler.stats.preemptions, recomputed_tokens=scheduler.stats.recomputed_tokens)
        tiers, store = kv_manager.tiers, runner.blocks.tiers
        if tiers is not None and store is not None:
            kv.update(kv_host_tier_bytes=store.host_bytes, kv_host_tier_blocks=len(tiers.host),
                      kv_disk_tier_blocks=len(tiers.disk), kv_tier_saved=tiers.stats.saved,
                      kv_tier_restored=tiers.stats.restored_host + tiers.stats.restored_disk)
        state_bytes += (use["shared"] + use["private"]) * block
    packed = {f for name in manifest.packed for f in manifest.packed_fqns(name)} & needed
    packed_values = sum(math.prod(p["shape"]) for p in manifest.packed.values())
    return MemoryReport(device=str(device), unique_weight_bytes=unique, resident_weight_bytes=resident,
                        duplicated_weight_bytes=resident - unique,
                        packed_weight_bytes=sum(weights[f].nbytes for f in packed),
                        packed_as_float_bytes=packed_values * parse_dtype(manifest.dtype).itemsize,
                        state_bytes=state_bytes, sessions_open=sessions_open,
                        state_bytes_per_session=state_bytes_per_session,
                        device_used_bytes=used - baseline_used, device_total_used_bytes=used,
                        capacity=scheduler.rows.free_rows, pool_rows=scheduler.rows.rows,
                        pool_bytes=runner.pool.nbytes + (runner.blocks.nbytes if runner.blocks is not None else 0),
                        pool_sizing=pool_sizing, sampler_bytes=runner.sampler.nbytes,
                        graph_buckets=runner.graph_buckets, graph_bytes=graphs.device_bytes if graphs else 0,
                        workspace_bytes=runner.workspace.nbytes, deterministic=deterministic, notes=notes, **kv)
