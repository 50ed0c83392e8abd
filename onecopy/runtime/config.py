"""How an Engine runs a bundle: one set of options, shared by `Engine.load`, the CLI and the replicas."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import InputError

DEFAULT_KV_DISK_BYTES = 16 << 30


@dataclass(frozen=True)
class EngineConfig:
    """The options of `Engine.load` (every field has a default that serves most uses).

    - ``max_sessions``: rows of the state pool (sessions open at once); default: on CUDA as many as
      ``memory_fraction`` of the device holds after what is in use and ``reserve_bytes`` (at most 256),
      8 on CPU. ``memory_budget`` bounds the pool's bytes. `MemoryReport.pool_sizing` says which rule applied.
    - ``cuda_graphs`` (default: on for CUDA): decode captured once per batch size in ``decode_buckets``
      (default 1, 2, 4, ... 128, then every 32 rows to 512 and every 64 past it, up to the pool size:
      `runtime.step.default_buckets`); steps run padded to the next bucket with graphs, and eagerly too
      when ``decode_buckets`` is given.
    - ``deterministic``: a session's logits, tokens and state are the same bit for bit whatever its row,
      the pool size and the sessions sharing its steps (the bundle's batch-invariant decode on CUDA, the
      decode one row per call on CPU; `runtime.step`). Default: the fastest decode, batched.
    - ``prefill_chunk`` (default 512): prompt tokens per prefill call; ``token_budget`` (default None: one
      chunk per iteration): tokens one scheduler iteration may take, a decoding session counting one and a
      prefill chunk its length (chunks are cut the same whatever the budget).
    - ``max_queue``: requests waiting for a row before QueueFullError (default unbounded); ``max_batch``:
      sessions per decode step (1: one at a time, the unbatched baseline).
    - ``prefix_cache`` (bundles with paged KV): a request starts on the cached KV blocks of the longest prefix
      of its prompt; in deterministic mode only blocks a prefill wrote (prompts') are cached and a hit ends at
      a multiple of ``prefill_chunk``, so a request gets the bits of its whole prompt prefilled. ``kv_blocks``:
      KV blocks of the paged cache (default: every row can reach max_seq_len; on CUDA, the free memory). Rows
      take blocks as they grow; when none is left the newest running request is preempted and resumed later
      (`runtime.scheduler`).
      ``new_token_ratio`` (default 1.0): the share of each running request's unwritten ``max_new_tokens``
      blocks kept free when admitting another (SGLang's name). 1: admitted requests all reach their
      ``max_new_tokens`` without a preemption (TensorRT-LLM's default, GUARANTEED_NO_EVICT); lower admits
      more on the bet that requests stop early, preemption paying for a lost bet.
    - Tiers of the prefix cache (`runtime.kv_tiers`; off by default): ``kv_host_bytes`` of host memory (pinned
      on CUDA) keep the blocks the device cache evicts, and ``kv_disk_dir`` (a directory; a subdirectory per
      model) keeps up to ``kv_disk_bytes`` (default 16 GiB) of those the host tier evicts, across restarts; a
      prompt whose prefix a tier holds loads those blocks instead of prefilling them.
    """

    max_sessions: int | None = None
    memory_budget: int | None = None
    memory_fraction: float = 0.9
    reserve_bytes: int | None = None
    cuda_graphs: bool | None = None
    deterministic: bool = False
    decode_buckets: tuple[int, ...] | None = None
    prefill_chunk: int | None = None
    max_queue: int | None = None
    max_batch: int | None = None
    prefix_cache: bool = True
    kv_blocks: int | None = None
    token_budget: int | None = None
    new_token_ratio: float = 1.0
    kv_host_bytes: int = 0
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = DEFAULT_KV_DISK_BYTES

    def __post_init__(self) -> None:
        for name in ("max_sessions", "kv_blocks", "prefill_chunk", "token_budget", "max_batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InputError(f"{name} must be >= 1, got {value}")
        if self.max_queue is not None and self.max_queue < 0:
            raise InputError(f"max_queue must be >= 0, got {self.max_queue}")
        if not 0 <= self.new_token_ratio <= 1:
            raise InputError(f"new_token_ratio must be in [0, 1], got {self.new_token_ratio}")
        for name in ("kv_host_bytes", "kv_disk_bytes"):
            if getattr(self, name) < 0:
                raise InputError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.kv_disk_dir is not None:
            object.__setattr__(self, "kv_disk_dir", str(self.kv_disk_dir))
        if not 0 < self.memory_fraction <= 1:
            raise InputError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.decode_buckets is not None:
            object.__setattr__(self, "decode_buckets", tuple(self.decode_buckets))

    @classmethod
    def of(cls, config: "EngineConfig | None" = None, **options: object) -> "EngineConfig":
        """``config`` (or the defaults) with ``options`` replacing its fields; InputError names an unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InputError(f"unknown engine option(s) {unknown}; the options are {sorted(known)}")
        values = {f.name: getattr(config, f.name) for f in fields(cls)} if config is not None else {}
        return cls(**{**values, **options})
