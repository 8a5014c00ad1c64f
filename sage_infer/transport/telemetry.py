"""Transport telemetry: the figures every `TransferRecord` carries, also as Prometheus metrics."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class TransportTelemetry:
    """`sage:kv_transfer_*` metrics. One per registry: build it once per process (see `default`)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.bytes = Counter("sage:kv_transfer_bytes", "KV bytes moved (as stored, before any wire conversion).",
                             ["backend", "direction"], registry=registry)
        self.seconds = Histogram("sage:kv_transfer_seconds", "Wall time of one whole transfer.",
                                 ["backend", "direction"], buckets=TRANSFER_BUCKETS, registry=registry)
        self.inflight = Gauge("sage:kv_transfer_inflight_chunks", "Chunks sent and not yet acknowledged.",
                              ["backend"], registry=registry)
        self.failures = Counter("sage:kv_transfer_failures", "Failed transfers by reason.", ["reason"],
                                registry=registry)

    _default: TransportTelemetry | None = None

    @classmethod
    def default(cls) -> TransportTelemetry:
        """The process-wide instance on prometheus_client's default registry."""
        if cls._default is None:
            cls._default = cls()
        return cls._default
