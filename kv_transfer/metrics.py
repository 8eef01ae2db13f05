"""Prometheus metrics for KV transfers (names start with splitserve_)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

BYTES = Counter("splitserve_kv_transfer_bytes", "KV bytes moved", ["direction", "backend"])
TRANSFERS = Counter("splitserve_kv_transfers", "KV transfers by outcome", ["direction", "backend", "outcome"])
LATENCY = Histogram(
    "splitserve_kv_transfer_seconds", "KV transfer latency, from ticket (receiver) or first layer (sender) to done",
    ["direction", "backend"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
IN_FLIGHT = Gauge("splitserve_kv_transfers_in_flight", "KV transfers in flight", ["direction", "backend"])


def record_end(direction: str, backend: str, error: Exception | None, seconds: float) -> None:
    """A transfer left flight: count its outcome (success, timeout, error, cancelled) and its latency."""
    IN_FLIGHT.labels(direction, backend).dec()
    outcome = "success" if error is None else type(error).__name__.removeprefix("Transfer").lower()
    TRANSFERS.labels(direction, backend, outcome).inc()
    if error is None:
        LATENCY.labels(direction, backend).observe(seconds)
