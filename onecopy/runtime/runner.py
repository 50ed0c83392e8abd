"""The model runner: the loaded methods, the state pool and KV blocks, the decode step and its graphs,
the sampler and each row's last token. It executes the scheduler's plans (state operations first) and
the sessions' direct calls; it makes no decision of its own beyond running a plan's equal-length prefill
chunks as one call where the prefill method takes several (`prefill_groups`). Callers hold the engine's lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..bundle import Manifest
from ..errors import InputError
from ..sampling import BatchSampler, DrawPlan, to_device
from .block_tensors import BlockTensors
from .graphs import DecodeGraphs
from .method import Method
from .phase_times import PhaseTimes
from .plan import PrefillChunk, RequestStart, StateOp, StepPlan, ZeroRow
from .pool import StatePool
from .step import DecodeStep, default_buckets, runs_one_row_per_call
from .weights import WeightStore
from .workspace import Workspace


# Most prompt tokens one batched prefill call takes: its activations come out of the memory reserve (~80 KB a token
# for the 8B shape), bounded whatever the token budget.
PREFILL_CALL_TOKENS = 8192


def takes_chunks(method: Method) -> bool:
    """Whether a prefill method takes chunks of several sessions at once (input_pos [N, T], rows [N])."""
    return method.role == "prefill" and len(method.spec.inputs[1].shape) == 2


class _Ready:
    """A completed event, for overlapped steps on a device that is synchronous anyway."""

    def synchronize(self) -> None:
        pass


@dataclass(eq=False)
class Launched:
    """A step queued on the device: its plan and its sampled ids on their way to the host."""

    plan: StepPlan
    ids: "torch.Tensor | list[int]"  # pinned host tensor the ids are copied into (or the ids, when synchronous)
    ready: "torch.cuda.Event | _Ready | None"  # recorded after the copy; None: the ids are here already

    def host_ids(self) -> list[int]:
        """The step's sampled ids (waits for the copy)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.ids if isinstance(self.ids, list) else self.ids.tolist()


class ModelRunner:
    """Runs one bundle's methods on one device for the rows of a state pool of ``rows`` sessions."""

    def __init__(self, path: Path, manifest: Manifest, device: torch.device, methods: dict[str, Method],
                 store: WeightStore, rows: int, *, deterministic: bool, cuda_graphs: bool | None,
                 decode_buckets: Sequence[int] | None, kv_blocks: int = 0) -> None:
        self.path, self.manifest, self.device = path, manifest, device
        self.methods, self.store = methods, store
        self.workspace = Workspace()
        paged = set(manifest.paged_state)
        self.pool = StatePool({k: v for k, v in manifest.state.items() if k not in paged}, rows, device)
        # Paged KV: ``kv_blocks`` blocks shared by every row through its block table.
        self.blocks = BlockTensors({k: manifest.state[k] for k in manifest.state if k in paged}, kv_blocks, rows,
                                   manifest.table_width, manifest.kv_block_size, device) if paged else None
        # Row ids spaced 16 bytes apart: a one-row view stays 16-byte aligned, as the packages were compiled for
        # (an unaligned input is copied by AOTI on every call).
        self._row_index = torch.arange(rows + 1, device=device).repeat_interleave(2)
        self._arange = torch.arange(manifest.max_seq_len, device=device)  # prefill contexts are views of it
        self.sampler = BatchSampler(rows + 1, int(manifest.config["vocab_size"]), device)
        # An overlapped step with constrained rows: its ids go to their grammars at the next step's masks
        self._unadvanced: tuple[DrawPlan, Launched] | None = None
        self.step: DecodeStep | None = None
        prefill = self.role("prefill")
        # Equal-length chunks of several prompts in one prefill call, where the method takes them; not in
        # deterministic mode, where a chunk's bits would depend on the chunks beside it (GEMM tiles per size).
        self.batched_prefill = prefill is not None and takes_chunks(prefill) and not deterministic
        self.times: PhaseTimes | None = None  # set by benchmarks: device time per phase of the steps
        decode = self.role("decode")
        if decode_buckets is not None and (not decode_buckets or min(decode_buckets) < 1 or max(decode_buckets) > rows):
            raise InputError(f"decode_buckets must be batch sizes in 1..{rows} (the pool's rows), got {list(decode_buckets)}")
        buckets = sorted(set(decode_buckets)) if decode_buckets else default_buckets(rows)
        if decode_buckets and max(buckets) < rows:
            buckets.append(rows)  # a step of every session must fit some graph
        if decode is not None:
            self.step = DecodeStep(decode, self.pool, self._pools(decode), self.workspace, buckets=buckets,
                                   pad=decode_buckets is not None,
                                   one_row_per_call=runs_one_row_per_call(decode.spec, deterministic))
            use_graphs = device.type == "cuda" and not decode.embeds_weights if cuda_graphs is None else cuda_graphs
            if use_graphs:
                self.step.graphs = DecodeGraphs(decode.spec, path / decode.spec.package, device, store,
                                                self.step.buckets, self.step.inputs, torch.cuda.Stream(device))

    # -- what is loaded -------------------------------------------------------------------------------
    def role(self, role: str) -> Method | None:
        """The loaded method with ``role`` (decode, prefill, encode), or None."""
        return next((m for m in self.methods.values() if m.role == role), None)

    @property
    def graph_buckets(self) -> list[int]:
        return self.step.graphs.buckets if self.step is not None and self.step.graphs is not None else []

    def _rows(self, row: int) -> torch.Tensor:
        """The int64 [1] rows input for one session: an aligned view, no host-to-device copy."""
        return self._row_index[2 * row:2 * row + 1]

    def _pools(self, method: Method) -> list[torch.Tensor]:
        """What a method takes after rows: the block table (paged KV), then one pool per state FQN."""
        paged = self.blocks.tensors if self.blocks is not None else {}
        pools = [paged[f] if f in paged else self.pool.tensors[f] for f in method.spec.state]
        return [self.blocks.table, *pools] if method.spec.paged else pools

    @staticmethod
    def _takes_context(method: Method) -> bool:
        return method.role == "prefill" and [i.name for i in method.spec.inputs][2:] == ["context"]

    # -- state operations -----------------------------------------------------------------------------
    def apply(self, ops: list[StateOp]) -> None:
        """Carry out queued state operations, in order (before anything that reads the state runs)."""
        blocks = []  # KV block and table operations: applied together (rows and blocks are separate state)
        for op in ops:
            if isinstance(op, ZeroRow):
                self.pool.zero_row(op.row)
                self.sampler.release(op.row)
            else:
                blocks.append(op)
        if blocks:
            self.blocks.apply(blocks)

    # -- one session's calls ------------------------------------------------------------------------
    def checked_inputs(self, name: str, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A direct call's inputs checked against method ``name`` (a prefill's context added); InputError
        before anything runs."""
        if name not in self.methods:
            raise InputError(f"bundle has no method {name!r}; it has {', '.join(self.methods)}")
        method = self.methods[name]
        if takes_chunks(method) and len(inputs) >= 2 and isinstance(inputs[1], torch.Tensor) and inputs[1].dim() == 1:
            inputs = (inputs[0], inputs[1][None], *inputs[2:])  # one session's positions [T] as its chunk's [1, T]
        if self._takes_context(method) and len(inputs) == 2 and isinstance(inputs[1], torch.Tensor) and inputs[1].numel():
            last = int(inputs[1].max())  # the context a chunk attends to ends at its last position
            inputs = (*inputs, self._arange[:last + 1] if 0 <= last < self.manifest.max_seq_len else torch.arange(last + 1))
        method.check_inputs(inputs)
        if method.role in ("decode", "prefill") and inputs[0].dim() == 2 and inputs[0].shape[0] != 1:
            raise InputError(f"{name} on one session takes a batch of 1, got {inputs[0].shape[0]}; "
                             "batches of sessions go through the scheduler")
        return inputs

    def written_positions(self, name: str, inputs: tuple[torch.Tensor, ...]) -> tuple[int, int] | None:
        """[lo, hi) of the KV positions a paged method writes (its input_pos), or None."""
        if not (self.methods[name].spec.paged and len(inputs) > 1 and inputs[1].numel()):
            return None
        lo, hi = (int(v) for v in torch.aminmax(inputs[1]))
        return lo, hi + 1

    def run(self, row: int, name: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Run method ``name`` on one row with inputs `checked_inputs` gave."""
        method = self.methods[name]
        with torch.inference_mode():
            return method(*inputs, self._rows(row), *self._pools(method))

    def prefill(self, row: int, start: int, ids: list[int]) -> torch.Tensor:
        """Prefill checked ``ids`` into ``row`` from position ``start``; logits [1, vocab]."""
        method = self.role("prefill")
        tokens = to_device(torch.tensor([ids], dtype=torch.long), self.device)
        positions = torch.arange(start, start + len(ids), device=self.device)
        if takes_chunks(method):
            positions = positions[None]
        context = (self._arange[:start + len(ids)],) if self._takes_context(method) else ()
        with torch.inference_mode():
            return method(tokens, positions, *context, self._rows(row), *self._pools(method))

    def prefill_chunks(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """Prefill equal-length ``chunks`` of several rows in one call (`batched_prefill`); logits [N, vocab],
        one row per chunk in order. Tokens, starts and rows reach the device in one copy."""
        if len(chunks) == 1:
            return self.prefill(chunks[0].row, chunks[0].start, chunks[0].tokens)
        method = self.role("prefill")
        n, t = len(chunks), len(chunks[0].tokens)
        # rows, starts, tokens: the inputs start at even offsets, 16-byte aligned as the package was compiled for
        host = torch.tensor([c.row for c in chunks] + [c.start for c in chunks] + [i for c in chunks for i in c.tokens],
                            dtype=torch.long)
        packed = to_device(host, self.device)
        rows, starts, tokens = packed[:n], packed[n:2 * n], packed[2 * n:].view(n, t)
        positions = starts[:, None] + self._arange[:t]
        context = self._arange[:max(c.start for c in chunks) + t]
        with torch.inference_mode():
            return method(tokens, positions, context, rows, *self._pools(method))

    def decode(self, rows: list[int], positions: list[int], tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One batched decode step (see `step.DecodeStep`): logits [n, vocab]."""
        if self.step is None:
            raise InputError(f"bundle {self.path} has no decode method; it has {', '.join(self.methods)}")
        return self.step(rows, positions, tokens)

    def encode(self, row: int, inputs: tuple[torch.Tensor, ...]) -> None:
        method = self.role("encode")
        with torch.inference_mode():
            method(*inputs, self._rows(row), *self._pools(method))

    # -- requests -----------------------------------------------------------------------------------
    def start(self, start: RequestStart) -> None:
        """Set up an admitted request on its row: its encode inputs, its sampling state."""
        if start.encode_inputs is not None:
            self.encode(start.row, start.encode_inputs)
        self.sampler.admit(start.row, start.params, start.seen, start.seed, start.emitted)

    def execute(self, plan: StepPlan, *, overlap: bool) -> Launched:
        """Queue ``plan``'s device work: its state operations, the admitted requests' set-up, the prefill
        chunks, the decode step, sampling, the copy of the ids.

        With ``overlap`` on CUDA it returns before the ids reach the host, so the next step is queued
        while this one runs.
        """
        self.apply(plan.state_ops)
        for start in plan.starts:
            self.start(start)
        logits: dict[int, torch.Tensor] = {}  # -1 - i: prefill chunk i's, 0: the decode step's
        for group in self.prefill_groups(plan.prefills):
            with self._phase("prefill"):
                out = self.prefill_chunks([plan.prefills[i] for i in group])
            for j, i in enumerate(group):
                logits[-1 - i] = out[j:j + 1]
        draw = self.sampler.plan(plan.sample_rows, plan.sample_positions, plan.sample_first) if plan.sample else None
        if plan.decode_rows:
            if plan.fed:
                packed = to_device(torch.tensor([[r for r, _ in plan.fed], [t for _, t in plan.fed]], dtype=torch.long),
                                   self.device)
                self.step.last_token.index_copy_(0, packed[0], packed[1])
            with self._phase("decode"):
                logits[0] = self.decode(plan.decode_rows, plan.decode_positions)
        if not plan.sample:
            return Launched(plan, [], None)
        with self._phase("sample"):
            if draw.constrained:
                self.advance_grammars()  # the step before's ids, waited for while this step's forward runs
            self.sampler.fill_masks(draw)  # (grammars: made on the host while the step above runs)
            tokens = self.sampler.sample(self._gather(plan, logits), draw)
        if self.step is not None:  # each sampled row's next decode input, left on the device
            self.step.last_token.index_copy_(0, draw.ints[0], tokens)
        if not overlap:
            launched = Launched(plan, tokens.tolist(), None)  # the one device-to-host copy of the step
        elif tokens.device.type != "cuda":
            launched = Launched(plan, tokens, _Ready())  # overlap on a synchronous device: for tests
        else:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)  # the one device-to-host copy of the step
            ready = torch.cuda.Event()
            ready.record()
            launched = Launched(plan, host, ready)
        if draw.constrained:
            # Their grammars take these ids before the next step's masks, and no sooner: the next step is queued
            # first, so its forward pass runs while the host waits for the ids and makes the masks. H100, 32-layer
            # 8B, half the rows constrained: a sync here cost 12% at batch 1 and 15% at 64 sessions, overlapped 1%
            # and 13.5% (results/structured_overhead_llama3-8b_synced_h100.json, _h100.json).
            self._unadvanced = (draw, launched)
            if not overlap:
                self.advance_grammars()
        return launched

    def advance_grammars(self) -> None:
        """Hand the last constrained step's ids to its rows' grammars (waiting for them if need be)."""
        if self._unadvanced is not None:
            draw, launched = self._unadvanced
            self._unadvanced = None
            self.sampler.advance(draw, launched.host_ids())

    def _phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.times.phase(name) if self.times is not None else contextlib.nullcontext()

    def prefill_groups(self, chunks: Sequence[PrefillChunk]) -> list[list[int]]:
        """The calls that prefill ``chunks``: with `batched_prefill`, the indices of each length's chunks
        (in order of first appearance; each chunk touches its own row, so the order between calls is free),
        `PREFILL_CALL_TOKENS` tokens a call at most; else one call per chunk."""
        if not self.batched_prefill:
            return [[i] for i in range(len(chunks))]
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(chunks):
            groups.setdefault(len(c.tokens), []).append(i)
        per_call = {t: max(1, PREFILL_CALL_TOKENS // t) for t in groups}  # chunks a call takes
        return [g[j:j + per_call[t]] for t, g in groups.items() for j in range(0, len(g), per_call[t])]

    def _gather(self, plan: StepPlan, logits: dict[int, torch.Tensor]) -> torch.Tensor:
        """The logits rows to sample, [n, vocab], in the plan's sample order (usually the decode output as is)."""
        idx = [i for _, i in plan.sample]
        if min(idx) >= 0:
            out = logits[0]
            if idx == list(range(out.shape[0])):
                return out
            return out.index_select(0, to_device(torch.tensor(idx), out.device))
        return torch.cat([logits[i] if i < 0 else logits[0][i:i + 1] for i in idx])

    # -- lifetime -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Free graphs, the pool and the sampler tables (the methods and weights are the engine's)."""
        if self.step is not None and self.step.graphs is not None:
            self.step.graphs.release()
        self.step = None
        self._unadvanced = None
        self.workspace.clear()
        self.pool.release_memory()
        if self.blocks is not None:
            self.blocks.release_memory()
        self.sampler.clear()
