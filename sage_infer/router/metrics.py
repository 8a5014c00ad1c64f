"""The router's own Prometheus metrics (its /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


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


class FleetMetrics(RouterMetrics):
    """The fleet router's metrics: its own, and how well its KV index predicts what the replicas report."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.predicted_cached = Counter("sage:router_predicted_cached_tokens", "Prompt tokens the router expected the "
                                        "chosen replica to hold (kv routing, requests whose replica reported usage).",
                                        registry=r)
        self.reported_cached = Counter("sage:router_reported_cached_tokens", "Prompt tokens the replicas reported as "
                                       "cached (usage.prompt_tokens_details.cached_tokens) for the same requests.",
                                       registry=r)
        self.prediction_error = Counter("sage:router_cached_tokens_abs_error", "Sum over those requests of "
                                        "|predicted - reported| cached tokens (relative error = this / reported).",
                                        registry=r)
        self.overhead = Histogram("sage:router_overhead_seconds", "The router's own time per request: from its body "
                                  "read to the call to the chosen replica (hash lookup and scoring included).",
                                  buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
                                           0.25, 1.0), registry=r)
        self.replica_up = Gauge("sage:router_replica_up", "1 while a replica is in the routing, else 0.", ["instance"],
                                registry=r)
        self.replica_blocks = Gauge("sage:router_replica_blocks", "Blocks a replica holds per medium, as its KV "
                                    "events tell the router.", ["instance", "medium"], registry=r)
        self.fleet_retries = Counter("sage:router_retries", "Requests sent to another replica because the one chosen "
                                     "was unreachable or refused before it answered.", registry=r)
        self.ttft_error = Counter("sage:router_ttft_prediction_abs_error_seconds", "Sum over streamed kv-routed "
                                  "requests of |predicted - observed| seconds to the first token (observed: from the "
                                  "call to the replica).", registry=r)
        self.ttft_observed = Counter("sage:router_ttft_observed_seconds", "Sum of the same requests' observed seconds "
                                     "to the first token (relative error = the error / this).", registry=r)
        self.moved = Counter("sage:router_prefix_moves", "kv-routed requests sent to a replica holding fewer of their "
                             "blocks than another live replica did (load outweighed the cache).", registry=r)
        self.lost = Counter("sage:router_replica_lost", "Times a replica left the routing (its event stream broke or "
                            "went silent, or a call to it failed).", ["instance"], registry=r)

