"""The router's own Prometheus metrics (its /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.routed = Counter("sage:router_requests", "Requests routed, by worker and role.", ["instance", "role"],
                              registry=r)
        self.failures = Counter("sage:router_worker_failures", "Calls to a worker that failed.", ["instance", "role"],
                                registry=r)
        self.colocated = Counter("sage:router_colocated", "Requests a decode worker computed whole (no split: "
                                 "several prompts, or no prefill worker up).", registry=r)
        self.outstanding = Gauge("sage:router_outstanding", "Requests in flight per worker.", ["instance", "role"],
                                 registry=r)
        self.prompt_tokens = Counter("sage:router_prompt_tokens", "Prompt tokens of requests routed by prefix "
                                     "overlap.", registry=r)
        self.cached_blocks = Gauge("sage:router_cached_blocks", "Blocks a prefill worker's prefix cache holds, "
                                   "as its events tell the router.", ["instance"], registry=r)
        self.waiting = Gauge("sage:router_waiting", "Requests waiting in the router for a decode worker slot.",
                             registry=r)
        self.overlap_tokens = Counter("sage:router_overlap_tokens", "Of those, tokens already cached on the "
                                      "prefill worker chosen (overlap hit rate = this / prompt tokens).", registry=r)
        self.tpot = Gauge("sage:router_tpot_seconds", "A decode worker's moving average of seconds per output "
                          "token, as the router measures it (streams: between events; others: call time / tokens, "
                          "an upper bound).", ["instance"], registry=r)
        self.slo = Counter("sage:router_slo_requests", "Requests under strategy slo, by target (ttft: streams "
                           "only; tpot) and whether it was met.", ["target", "met"], registry=r)
        self.retries = Counter("sage:router_decode_retries", "Requests sent to another decode worker because the "
                               "one chosen was unreachable before it answered.", registry=r)
