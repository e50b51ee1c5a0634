"""The coordinator's Prometheus metrics, in a registry of its own.

Most values are read from the round controller when Prometheus scrapes (rounds, bytes, losses,
round durations), so the endpoint always agrees with `geodiloco status` and the round log.
Events the controller does not keep (a contribution's outcome and reason, lease expiries, a
push's compression ratio) are counted by the servicers through this object.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from geodiloco.coordinator.rounds import RoundController

# Rounds last seconds (tests, demo) to tens of minutes (large models over slow links).
ROUND_BUCKETS = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
FP32_BYTES = 4


class CoordinatorMetrics:
    """Everything `/metrics` shows for one coordinator."""

    def __init__(self, controller: RoundController) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_ControllerCollector(controller))
        self.contributions = Counter(
            "geodiloco_contributions",
            "Pushes by outcome: accepted, duplicate, late (round already closed) or rejected "
            "(reason: the gRPC status code sent back)",
            ["site", "outcome", "reason"],
            registry=self.registry,
        )
        self.lease_expiries = Counter(
            "geodiloco_lease_expiries",
            "Sites marked lost because no heartbeat arrived within the lease",
            ["site"],
            registry=self.registry,
        )
        self.uplink_ratio = Gauge(
            "geodiloco_uplink_compression_ratio",
            "fp32 size / payload size of the site's last accepted pseudo-gradient",
            ["site"],
            registry=self.registry,
        )

    def contribution(self, site: str, outcome: str, reason: str = "") -> None:
        self.contributions.labels(site=site or "unknown", outcome=outcome, reason=reason).inc()

    def push_compressed(self, site: str, numel: int, payload_bytes: int) -> None:
        if payload_bytes:
            self.uplink_ratio.labels(site=site).set(numel * FP32_BYTES / payload_bytes)


class _ControllerCollector:
    """Reads the controller's own bookkeeping at scrape time (from the HTTP server's thread;
    it only reads numbers and copies lists, never changes anything)."""

    def __init__(self, controller: RoundController) -> None:
        self.c = controller

    def collect(self) -> Iterator[Metric]:
        c = self.c
        history = list(c.history)
        sites = list(c.sites.values())
        yield _gauge("geodiloco_round", "The open round (= rounds committed so far)", c.round)
        yield _gauge("geodiloco_rounds_planned", "Rounds the run trains in all", c.cfg.rounds)
        yield CounterMetricFamily(
            "geodiloco_rounds_committed", "Rounds committed (durable and published)", value=len(history)
        )
        yield CounterMetricFamily(
            "geodiloco_tokens", "Tokens in committed contributions", value=sum(h.tokens for h in history)
        )
        yield _round_durations(h.duration_s for h in history)
        wan = CounterMetricFamily(
            "geodiloco_wan_bytes",
            "Serialized protobuf bytes exchanged with each site (up: received from it, down: sent to it)",
            labels=["site", "direction"],
        )
        up = GaugeMetricFamily("geodiloco_site_up", "1 while the site holds a lease", labels=["site"])
        train = GaugeMetricFamily(
            "geodiloco_reported_train_loss", "Site's last reported train loss", labels=["site"]
        )
        evals = GaugeMetricFamily(
            "geodiloco_reported_eval_loss", "Site's last reported eval loss, on its slice", labels=["site"]
        )
        for s in sites:
            wan.add_metric([s.name, "up"], s.bytes_in)
            wan.add_metric([s.name, "down"], s.bytes_out)
            up.add_metric([s.name], 1.0 if s.state == "joined" else 0.0)
            if not math.isnan(s.train_loss):
                train.add_metric([s.name], s.train_loss)
            if not math.isnan(s.eval_loss):
                evals.add_metric([s.name], s.eval_loss)
        yield from (wan, up, train, evals)
        # families without a value yet are still listed (HELP and TYPE, no sample)
        evals_global = GaugeMetricFamily(
            "geodiloco_eval_loss", "Eval loss over the whole eval set, last reported round", labels=[]
        )
        reported = [h for h in history if h.eval_count]
        if reported:
            evals_global.add_metric([], reported[-1].eval_loss)
        down = GaugeMetricFamily(
            "geodiloco_downlink_compression_ratio", "fp32 size / payload of the last update", labels=[]
        )
        if history and history[-1].update_bytes:
            down.add_metric([], c.num_params * FP32_BYTES / history[-1].update_bytes)
        yield from (evals_global, down)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _round_durations(durations: Iterator[float]) -> HistogramMetricFamily:
    values = list(durations)
    buckets = [(str(float(le)), float(sum(1 for d in values if d <= le))) for le in ROUND_BUCKETS]
    buckets.append(("+Inf", float(len(values))))
    return HistogramMetricFamily(
        "geodiloco_round_duration_seconds",
        "Time from a round's opening to its commit",
        buckets=buckets,
        sum_value=sum(values),
    )
