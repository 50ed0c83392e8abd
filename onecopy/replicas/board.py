"""What the ingress knows about each replica: the figures each one reports every fraction of a second.

Replicas push their figures (`ReplicaReport`) to the ingress through a Serve handle; /health lists
them and /metrics exports them labelled by replica. A replica that stops reporting is marked
unresponsive after ``stale_s`` and forgotten after ``forget_s`` (Ray has replaced it by then).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from prometheus_client.core import GaugeMetricFamily


@dataclass
class ReplicaReport:
    """One replica's state as it reported it."""

    replica: str
    status: str  # "ok", "failed" (its engine failed; Ray replaces it) or "shutting down"
    rows_total: int
    rows_free: int
    running: int
    waiting: int
    conversations: int
    device_memory_used_bytes: int
    device: str
    reason: str | None = None


# (metric name, help, field): the per-replica gauges /metrics exports
_GAUGES = (
    ("onecopy_replica_sessions_running", "Requests being generated, per replica", "running"),
    ("onecopy_replica_requests_waiting", "Requests waiting for a free row, per replica", "waiting"),
    ("onecopy_replica_rows_free", "Free rows of the replica's state pool", "rows_free"),
    ("onecopy_replica_rows_total", "Rows of the replica's state pool", "rows_total"),
    ("onecopy_replica_conversations_cached", "Idle conversations the replica keeps", "conversations"),
    ("onecopy_replica_device_memory_used_bytes", "Device memory in use on the replica's device (device-level)",
     "device_memory_used_bytes"),
)


class ReplicaBoard:
    """The latest report of every replica. Also a Prometheus collector (register it in a registry)."""

    def __init__(self, stale_s: float = 3.0, forget_s: float = 10.0) -> None:
        self.stale_s, self.forget_s = stale_s, forget_s
        self._reports: dict[str, tuple[ReplicaReport, float]] = {}

    def report(self, report: ReplicaReport) -> None:
        self._reports[report.replica] = (report, time.monotonic())

    def remove(self, replica: str) -> None:
        """A replica that shut down cleanly says so."""
        self._reports.pop(replica, None)

    def replicas(self) -> list[dict[str, Any]]:
        """Each replica's last report, its age and its state ("ok", "failed", "shutting down" or
        "unresponsive"), sorted by id; replicas silent for ``forget_s`` are dropped."""
        now = time.monotonic()
        for rid in [r for r, (_, t) in self._reports.items() if now - t > self.forget_s]:
            del self._reports[rid]
        out = []
        for rid in sorted(self._reports):
            report, t = self._reports[rid]
            entry = asdict(report)
            entry["age_s"] = round(now - t, 3)
            if now - t > self.stale_s:
                entry["status"] = "unresponsive"
            out.append(entry)
        return out

    def live(self) -> list[dict[str, Any]]:
        return [r for r in self.replicas() if r["status"] == "ok"]

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of /health: 200 while at least one replica serves."""
        replicas = self.replicas()
        live = [r for r in replicas if r["status"] == "ok"]
        status = "ok" if live and len(live) == len(replicas) else "degraded" if live else "unavailable"
        body = {"status": status, "replicas": replicas, "rows_free": sum(r["rows_free"] for r in live),
                "running": sum(r["running"] for r in live), "waiting": sum(r["waiting"] for r in live)}
        return (200 if live else 503), body

    def collect(self) -> Iterator[GaugeMetricFamily]:
        replicas = [r for r in self.replicas() if r["status"] != "unresponsive"]
        for name, help_text, key in _GAUGES:
            g = GaugeMetricFamily(name, help_text, labels=["replica"])
            for r in replicas:
                g.add_metric([r["replica"]], float(r[key]))
            yield g
        up = GaugeMetricFamily("onecopy_replica_up", "1 while the replica reports and serves", labels=["replica"])
        for r in self.replicas():
            up.add_metric([r["replica"]], 1.0 if r["status"] == "ok" else 0.0)
        yield up
