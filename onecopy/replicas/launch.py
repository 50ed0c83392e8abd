"""Building and running the replicated server: a Ray Serve application of one `Ingress` and N
`EngineReplica`s, on a local Ray cluster or one already running (`--ray-address auto|ADDR`)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..errors import InputError
from .deployments import EngineReplica, Ingress, IngressSpec, ReplicaSpec

log = logging.getLogger(__name__)

APP_NAME = "onecopy"
INGRESS = "OnecopyIngress"
REPLICA = "EngineReplica"
# Serve's own cap on a replica's requests in flight: far above any engine's rows plus queue, so the
# engine's admission (429 past max_queue) decides, not Serve's queueing.
MAX_ONGOING = 100_000


def build_application(spec: ReplicaSpec, replicas: int, *, grace_s: float = 10.0,
                      ingress: IngressSpec | None = None) -> serve.Application:
    """The Serve application: ``replicas`` engines, each on one GPU (CUDA) or one CPU, behind one ingress."""
    if replicas < 1:
        raise InputError(f"--replicas must be >= 1, got {replicas}")
    ingress = ingress or IngressSpec(max_body_bytes=spec.server.max_body_bytes,
                                     conversation_ttl_s=spec.server.conversation_ttl_s,
                                     retry_after_s=spec.server.retry_after_s)
    gpus = 1 if spec.device.startswith("cuda") else 0
    engines = serve.deployment(EngineReplica).options(
        name=REPLICA, num_replicas=replicas, max_ongoing_requests=MAX_ONGOING,
        ray_actor_options={"num_cpus": 1, "num_gpus": gpus},
        request_router_config=RequestRouterConfig(request_router_class="onecopy.replicas.router.SessionAffinityRouter"),
        graceful_shutdown_timeout_s=grace_s, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=2.0, health_check_timeout_s=30.0,
    )
    front = serve.deployment(Ingress).options(name=INGRESS, num_replicas=1, max_ongoing_requests=MAX_ONGOING,
                                              ray_actor_options={"num_cpus": 0},
                                              graceful_shutdown_timeout_s=grace_s, graceful_shutdown_wait_loop_s=0.5)
    return front.bind(engines.bind(spec, INGRESS), ingress)


class ReplicatedServer:
    """The application running on Ray: `start()` connects to (or starts) Ray and deploys; `stop()`
    drains every replica (Serve's graceful shutdown) and, if it started Ray, stops it."""

    def __init__(self, spec: ReplicaSpec, replicas: int, *, ray_address: str | None = None, host: str = "127.0.0.1",
                 port: int = 8000, grace_s: float = 10.0, num_cpus: int | None = None) -> None:
        self.spec, self.replicas, self.ray_address = spec, replicas, ray_address
        self.host, self.port, self.grace_s, self.num_cpus = host, port, grace_s, num_cpus
        self._started_ray = self._running = False
        self._ray_dir: str | None = None  # the local cluster's session files, removed when it stops
        self._on_signal = None  # serve_forever's: a signal drains, whenever it comes

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ReplicatedServer":
        app = build_application(self.spec, self.replicas, grace_s=self.grace_s)
        if not ray.is_initialized():
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            if self.ray_address is None:  # a local cluster, ours to stop
                cpus = self.num_cpus or max(os.cpu_count() or 1, self.replicas + 1)
                # Its own temp dir, not /tmp/ray: the cluster is ours, so are its files (gone at stop).
                self._ray_dir = tempfile.mkdtemp(prefix="onecopy-ray-")
                try:
                    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False,
                             logging_level=logging.WARNING, _temp_dir=self._ray_dir)
                except BaseException:
                    shutil.rmtree(self._ray_dir, ignore_errors=True)
                    self._ray_dir = None
                    raise
                self._started_ray = True
            else:
                ray.init(address=self.ray_address, log_to_driver=False, logging_level=logging.WARNING)
            if self._on_signal is not None:  # ray.init installed its own SIGTERM handler (it exits at once)
                signal.signal(signal.SIGTERM, self._on_signal)
        serve.start(http_options={"host": self.host, "port": self.port}, logging_config={"log_level": "WARNING"})
        self._running = True
        serve.run(app, name=APP_NAME, route_prefix="/")
        return self

    def drain(self) -> None:
        """Refuse new requests and wait up to ``grace_s`` for those in flight to finish."""
        ingress = serve.get_app_handle(APP_NAME)
        deadline = time.monotonic() + self.grace_s
        while ingress.drain.remote().result() > 0 and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop(self, drain: bool = False) -> None:
        """Shut the application down (``drain``: let requests in flight finish first, within grace_s)."""
        if not self._running:
            return
        self._running = False
        try:
            if drain:
                try:
                    self.drain()
                except Exception as e:  # the ingress is gone: nothing left to wait for
                    log.warning("could not drain the ingress: %s", e)
            serve.shutdown()  # drains: each replica finishes its requests within grace_s, then closes its engine
        finally:
            if self._started_ray:
                ray.shutdown()
                self._started_ray = False
            if self._ray_dir is not None:
                shutil.rmtree(self._ray_dir, ignore_errors=True)
                self._ray_dir = None

    def __enter__(self) -> "ReplicatedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Until SIGINT/SIGTERM, then drain and stop (a clean exit)."""
        stop = threading.Event()

        def on_signal(*_: object) -> None:
            stop.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        self._on_signal = on_signal
        try:
            self.start()
            while not stop.wait(0.5):
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.stop(drain=True)
