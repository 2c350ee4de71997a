"""Metric families as Prometheus's text exposition format (pure: families in, bytes out).

prometheus_client writes the text (escaping of label values, HELP/TYPE lines, float format),
so what node_exporter's textfile collector and a Prometheus scrape read is what the library
everyone uses writes. The families themselves come from gpufleet.core.metrics.
"""
from __future__ import annotations

from typing import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gpufleet.core.metrics import COUNTER, Family

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _metric(family: Family) -> Metric:
    metric: Metric
    if family.kind == COUNTER:
        metric = CounterMetricFamily(family.name, family.help, labels=list(family.labels))
    else:
        metric = GaugeMetricFamily(family.name, family.help, labels=list(family.labels))
    for values, value in family.samples:
        metric.add_metric(list(values), value)  # type: ignore[attr-defined]
    return metric


class _Fixed:
    """A collector that yields the families it was given (one registry per rendering)."""

    def __init__(self, families: Sequence[Family]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield _metric(family)


def exposition(families: Sequence[Family]) -> bytes:
    """The text format (version 0.0.4) of ``families``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families))  # type: ignore[arg-type]
    return generate_latest(registry)
