"""Prometheus metrics of one server (its own registry: two servers in one process never mix)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from ..runtime.memory import device_used

if TYPE_CHECKING:
    from ..runtime.engine import Engine
    from ..runtime.stream import TokenStream
    from .conversations import ConversationCache

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)


def _device_used(engine: "Engine") -> float:
    """Device bytes in use now (the whole device on CUDA, this process on CPU); no device sync. Nothing once
    the engine has failed: a failed CUDA context refuses even cudaMemGetInfo, and a scrape must not fail."""
    return 0.0 if engine.closed or engine.failed else float(device_used(engine.device, sync=False))


class _Preemptions:
    """The scheduler's preemption counters, read at each scrape (they live in the scheduler, not here)."""

    def __init__(self, engine: "Engine") -> None:
        self.stats = engine.scheduler.stats

    def collect(self):
        yield CounterMetricFamily("onecopy_preemptions", "Running requests whose KV blocks were taken for others "
                                  "(resumed later by recomputing their ids)", value=self.stats.preemptions)
        yield CounterMetricFamily("onecopy_recomputed_tokens", "Ids preempted requests put back in their rows",
                                  value=self.stats.recomputed_tokens)


class _TierCounts:
    """The KV tiers' counters (`runtime.kv_tiers.TierStats`), read at each scrape."""

    def __init__(self, stats) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats
        yield CounterMetricFamily("onecopy_kv_tier_saved_blocks", "Cached KV blocks the tiers kept (copied ahead of "
                                  "their eviction, or on it)", value=s.saved)
        yield CounterMetricFamily("onecopy_kv_tier_warmed_blocks", "Disk tier blocks read into the host tier when the "
                                  "engine started", value=s.warmed)
        restored = CounterMetricFamily("onecopy_kv_tier_restored_blocks", "KV blocks loaded back from a tier instead "
                                       "of prefilled", labels=["tier"])
        restored.add_metric(["host"], s.restored_host)
        restored.add_metric(["disk"], s.restored_disk)
        yield restored
        yield CounterMetricFamily("onecopy_kv_tier_load_failures", "Disk tier files gone or failing their check when "
                                  "a load was decided (prefilled instead)", value=s.load_failures)


class ServerMetrics:
    def __init__(self, engine: "Engine", cache: "ConversationCache | None") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("onecopy_requests", "Requests by endpoint and HTTP status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("onecopy_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("onecopy_generation_tokens", "Generated tokens", registry=r)
        self.prefill_saved = Counter("onecopy_prefix_reused_tokens", "Prompt tokens not prefilled again: found in "
                                     "the prefix cache or a kept conversation", registry=r)
        self.ttft = Histogram("onecopy_time_to_first_token_seconds", "Time from request to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("onecopy_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        sched = engine.scheduler
        Gauge("onecopy_sessions_running", "Requests being generated", registry=r).set_function(lambda: sched.running)
        Gauge("onecopy_requests_waiting", "Requests waiting for a free row", registry=r).set_function(
            lambda: sched.waiting)
        Gauge("onecopy_rows_free", "Free rows of the state pool", registry=r).set_function(
            lambda: engine.free_rows)
        Gauge("onecopy_rows_total", "Rows of the state pool", registry=r).set_function(
            lambda: 0 if engine.closed else engine.max_sessions)
        Gauge("onecopy_conversations_cached", "Idle conversations kept on the device", registry=r).set_function(
            lambda: len(cache) if cache is not None else 0)
        self.responses_stored = Gauge("onecopy_responses_stored", "Responses API turns kept in memory for "
                                      "previous_response_id and GET (--state-dir: files too)", registry=r)
        Gauge("onecopy_device_memory_used_bytes", "Device memory in use (device-level)", registry=r).set_function(
            lambda: _device_used(engine))
        blocks = engine.scheduler.kv
        if blocks is not None:  # paged KV: blocks by who reads them (shared: a prompt held once for several sessions)
            kv = Gauge("onecopy_kv_blocks", "KV blocks: shared (2+ sessions), private, cached (no session, evictable), "
                       "free", ["kind"], registry=r)
            for kind in ("shared", "private", "cached", "free"):  # host bookkeeping: readable after a failure too
                kv.labels(kind).set_function(lambda kind=kind: 0 if engine.closed else blocks.usage()[kind])
            r.register(_Preemptions(engine))
            if blocks.tiers is not None:
                tier = Gauge("onecopy_kv_tier_blocks", "KV blocks the prefix cache's tiers hold: host memory, disk",
                             ["tier"], registry=r)
                tier.labels("host").set_function(lambda: len(blocks.tiers.host))
                tier.labels("disk").set_function(lambda: len(blocks.tiers.disk))
                r.register(_TierCounts(blocks.tiers.stats))

    def observe(self, stream: "TokenStream", reused: int) -> None:
        """Count a finished generation."""
        self.prompt_tokens.inc(len(stream.prompt_ids) + reused)
        self.prefill_saved.inc(reused + stream.cached_tokens)
        self.generated_tokens.inc(len(stream.ids))
        if stream.time_to_first_token is not None:
            self.ttft.observe(stream.time_to_first_token)
        for a, b in zip(stream.token_times, stream.token_times[1:]):
            self.itl.observe(b - a)
