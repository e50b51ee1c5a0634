"""Prometheus endpoints: the shared HTTP server, and the site daemon's own metrics.

The site's rank 0 serves ``/metrics`` when ``geodiloco site run --metrics-port`` is given
(the launcher hands the port to the ranks as ``GEODILOCO_METRICS_PORT``/``_HOST``); the other
ranks keep quiet. The coordinator's metrics are in :mod:`geodiloco.coordinator.round_metrics`.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from geodiloco.progress import Progress

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger("geodiloco.prometheus")

PORT_ENV = "GEODILOCO_METRICS_PORT"
HOST_ENV = "GEODILOCO_METRICS_HOST"
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
SYNC_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900)


@dataclass(slots=True)
class MetricsServer:
    """A running ``/metrics`` HTTP endpoint (a daemon thread of prometheus-client)."""

    httpd: WSGIServer
    host: str

    @property
    def port(self) -> int:
        return int(self.httpd.server_port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve ``registry`` on ``http://host:port/metrics`` (port 0 picks a free one)."""
    try:
        httpd, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(f"metrics: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    server = MetricsServer(httpd, host)
    log.info("metrics on http://%s:%d/metrics", host, server.port)
    return server


class SiteTelemetry:
    """Rank 0's metrics and training progress; on other ranks every call does nothing.

    The training loop calls :meth:`step` after each inner step and :meth:`round` after each
    outer sync; that is all it needs to know about Prometheus or progress bars. ``traffic``
    gives the outer-sync client's running (sent, received) byte totals, read at each scrape.
    """

    def __init__(
        self,
        site: str,
        *,
        enabled: bool,
        total_steps: int,
        port: int | None,
        host: str,
        traffic: Callable[[], tuple[int, int]],
    ) -> None:
        self.enabled = enabled
        self.registry = CollectorRegistry()
        labels = ["site"]
        r = self.registry
        self._step = Histogram(
            "geodiloco_site_inner_step_seconds",
            "Wall time of one inner step",
            labels,
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self._tps = Gauge(
            "geodiloco_site_tokens_per_second", "Site-wide tokens/s over the last round", labels, registry=r
        )
        self._train = Gauge(
            "geodiloco_site_train_loss", "Mean inner train loss of the last round", labels, registry=r
        )
        self._eval = Gauge(
            "geodiloco_site_eval_loss", "Eval loss on the site's slice, last round", labels, registry=r
        )
        self._rounds = Counter(
            "geodiloco_site_rounds", "Outer rounds this site completed", labels, registry=r
        )
        self._round = Gauge("geodiloco_site_round", "The round the site trains now", labels, registry=r)
        self._sync = Histogram(
            "geodiloco_site_sync_seconds",
            "Push, wait for the commit, and pull: one outer sync",
            labels,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        r.register(_TrafficCollector(site, traffic))
        for metric in (self._step, self._rounds, self._round, self._sync):
            metric.labels(site)  # shown from the first scrape, at zero
        self.site = site
        self._round_tokens = 0
        self._round_seconds = 0.0
        self.server = serve_metrics(r, host, port) if enabled and port is not None else None
        self.progress = Progress(f"site {site} training", total_steps) if enabled else None

    @classmethod
    def start(
        cls, site: str, rank: int, total_steps: int, traffic: Callable[[], tuple[int, int]]
    ) -> SiteTelemetry:
        """Rank 0 serves metrics on the port the launcher passed down (none if not given)."""
        port = os.environ.get(PORT_ENV)
        return cls(
            site,
            enabled=rank == 0,
            total_steps=max(1, total_steps),
            port=int(port) if port else None,
            host=os.environ.get(HOST_ENV, "127.0.0.1"),
            traffic=traffic,
        )

    def step(self, seconds: float, tokens: int, round_: int, step: int) -> None:
        """One inner step of the whole site (``tokens`` over all its ranks)."""
        if not self.enabled:
            return
        self._step.labels(self.site).observe(seconds)
        self._round.labels(self.site).set(round_)
        self._round_tokens += tokens
        self._round_seconds += seconds
        if self.progress is not None:
            self.progress.update(step, f"round {round_}")

    def round(
        self,
        *,
        train_loss: float,
        eval_loss: float,
        sync_seconds: float,
    ) -> None:
        """An outer sync finished."""
        if not self.enabled:
            return
        site = self.site
        self._rounds.labels(site).inc()
        self._sync.labels(site).observe(sync_seconds)
        if math.isfinite(train_loss):
            self._train.labels(site).set(train_loss)
        if math.isfinite(eval_loss):
            self._eval.labels(site).set(eval_loss)
        if self._round_seconds > 0:
            self._tps.labels(site).set(self._round_tokens / self._round_seconds)
        self._round_tokens, self._round_seconds = 0, 0.0

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.server is not None:
            self.server.close()


class _TrafficCollector:
    def __init__(self, site: str, traffic: Callable[[], tuple[int, int]]) -> None:
        self.site = site
        self.traffic = traffic

    def collect(self) -> Iterator[Metric]:
        sent, received = self.traffic()
        family = CounterMetricFamily(
            "geodiloco_site_wan_bytes",
            "Serialized protobuf bytes to (up) and from (down) the coordinator",
            labels=["site", "direction"],
        )
        family.add_metric([self.site, "up"], sent)
        family.add_metric([self.site, "down"], received)
        yield family
