"""Prometheus metrics of one service process: request latency per route template for anyone,
and, for an admin key, the memories stored and jobs queued in its own tenant (read at scrape
time): counts summed over tenants would tell each tenant how busy the others are.

Each app gets its own registry (no module-level globals), so several apps — e.g. in tests —
never mix their numbers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import EngramError
from ..model import JobStatus

if TYPE_CHECKING:
    from .. import Memory

log = logging.getLogger("engram.server")

# Seconds; the searches this service does take 10-200 ms, adds up to a second with long texts.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _StoreGauges(Collector):
    def __init__(self, memories: Sequence[Memory]) -> None:
        self.memories = memories

    def collect(self) -> Iterator[GaugeMetricFamily]:
        memories = GaugeMetricFamily("engram_memories_stored", "Visible memories of the tenant")
        queued = GaugeMetricFamily("engram_jobs_queued", "Background jobs waiting to run, of the tenant")
        n_mem = n_jobs = 0
        for mem in self.memories:
            try:
                counts = mem.stats()
                n_mem += counts.memories
                n_jobs += counts.jobs[JobStatus.QUEUED.value]
            except EngramError as exc:  # a scrape must not fail because the db is down
                log.warning("metrics: cannot read a tenant's counts: %s", exc)
        memories.add_metric([], n_mem)
        queued.add_metric([], n_jobs)
        yield memories
        yield queued


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "engram_http_request_duration_seconds", "Request latency by route template",
            ["method", "route", "status"], buckets=BUCKETS, registry=self.registry)

    def render(self, memories: Sequence[Memory] = ()) -> tuple[bytes, str]:
        """The process metrics, and the store gauges of `memories` when any are given."""
        body = generate_latest(self.registry)
        if memories:
            own = CollectorRegistry()
            own.register(_StoreGauges(memories))
            body += generate_latest(own)
        return body, CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Times every HTTP request; labels it with the route template (`/v1/memories/{id}`), never
    the raw path, so ids do not explode the number of series."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.latency.labels(scope["method"], _route(scope), str(status[0])).observe(
                time.perf_counter() - start)


def _route(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None) or scope.get("engram.route")
    return path if isinstance(path, str) else "unmatched"
