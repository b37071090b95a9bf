"""Prometheus metrics, one registry per app (two apps in one process never mix counts).

Request-level figures (outcomes, tokens, latencies) are recorded as responses finish; the
engine's figures (queue, running sequences, KV cells) are read from ``ctx.stats()`` at each
scrape by a collector, so they are never stale.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import llamax
from llamax.stats import stat_fields

__all__ = [
    "ScrapeCollector",
    "ServerMetrics",
    "TokenClock",
    "engine_metrics",
    "pool_metrics",
]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ScrapeCollector(Collector):
    """Gauges and counters a function computes at each scrape."""

    def __init__(self, figures: Callable[[], Iterator[Metric]]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        yield from self._figures()


def _engine_figures(stats: Callable[[], llamax.ContextStats | None]) -> Iterator[Metric]:
    if (found := stats()) is not None:
        yield from engine_metrics([((), found)])


def engine_metrics(
    rows: Sequence[tuple[Sequence[str], llamax.ContextStats]], labels: Sequence[str] = ()
) -> Iterator[Metric]:
    """The engine's gauges and counters (KV cells, queue, prefix tiers ...), one sample per row:
    its label values (for ``labels``: ``("model",)`` with several models) and its stats.
    Each is a :class:`~llamax.ContextStats` field whose metadata names its metric
    (:func:`llamax.stats.stat_fields`): a new field with a metric is exported as it is."""
    for found in stat_fields():
        if (spec := found.metric) is None:
            continue
        family = GaugeMetricFamily if spec.kind == "gauge" else CounterMetricFamily
        metric = family(spec.name, spec.help, labels=list(labels))
        for values, stats in rows:
            metric.add_metric(list(values), float(found.value(stats)))
        yield metric


class ServerMetrics:
    """The server's metrics in their own :class:`CollectorRegistry`.

    Args:
        stats: Returns the context's stats, or ``None`` while the model loads.
    """

    def __init__(self, stats: Callable[[], llamax.ContextStats | None]) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "llamax_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
            registry=reg,
        )  # fmt: skip
        self.prompt_tokens = Counter("llamax_prompt_tokens", "Prompt tokens", registry=reg)
        self.generated_tokens = Counter("llamax_generated_tokens", "Generated tokens", registry=reg)
        self.cached_tokens = Counter(
            "llamax_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
            registry=reg,
        )  # fmt: skip
        self.ttft = Histogram(
            "llamax_time_to_first_token_seconds", "Time to the first streamed token",
            buckets=_LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.inter_token = Histogram(
            "llamax_inter_token_latency_seconds", "Time between streamed chunks of a choice",
            buckets=_LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.duration = Histogram(
            "llamax_request_duration_seconds", "Time from request to the response's end",
            ["endpoint"], buckets=_DURATION_BUCKETS, registry=reg,
        )  # fmt: skip
        self.in_flight = Gauge(
            "llamax_requests_in_flight", "Requests admitted and not finished", registry=reg
        )
        reg.register(ScrapeCollector(lambda: _engine_figures(stats)))

    def record_usage(self, usage: Mapping[str, Any] | None) -> None:
        """Count an OpenAI ``usage`` object's tokens."""
        if not usage:
            return
        self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        self.generated_tokens.inc(usage.get("completion_tokens", 0))
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens.inc(details.get("cached_tokens", 0))

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


class TokenClock:
    """Times one streamed request: the first content chunk, then the gaps per choice.

    Args:
        metrics: Where to record.
        started: ``time.perf_counter()`` when the request arrived.
    """

    def __init__(self, metrics: ServerMetrics, started: float) -> None:
        self._metrics = metrics
        self.started = started
        self._last: dict[int, float] = {}

    def tick(self, index: int) -> None:
        """A chunk with content for choice ``index`` is about to be sent."""
        now = time.perf_counter()
        if not self._last:
            self._metrics.ttft.observe(now - self.started)
        elif index in self._last:
            self._metrics.inter_token.observe(now - self._last[index])
        self._last[index] = now


def pool_metrics(rows: Sequence[tuple[str, bool, int, Mapping[str, int], int]]) -> Iterator[Metric]:
    """A model pool's figures from ``(name, loaded, num_users, num_loads by outcome,
    num_unloads)`` rows: ``llamax_model_loaded{model}``, the requests holding each model,
    and its loads and unloads."""
    loaded = GaugeMetricFamily(
        "llamax_model_loaded", "1 while the model is loaded", labels=["model"]
    )
    users = GaugeMetricFamily(
        "llamax_model_requests", "Requests holding the model (running or waiting for its load)",
        labels=["model"],
    )  # fmt: skip
    loads = CounterMetricFamily(
        "llamax_model_loads", "Model loads by outcome", labels=["model", "outcome"]
    )
    unloads = CounterMetricFamily("llamax_model_unloads", "Model unloads", labels=["model"])
    for name, is_loaded, num_users, num_loads, num_unloads in rows:
        loaded.add_metric([name], float(is_loaded))
        users.add_metric([name], num_users)
        for outcome, count in num_loads.items():
            loads.add_metric([name, outcome], count)
        unloads.add_metric([name], num_unloads)
    yield from (loaded, users, loads, unloads)
