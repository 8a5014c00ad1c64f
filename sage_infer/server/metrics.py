"""Prometheus metrics named like vLLM's, under ``sage:``, each with a ``model_name`` label.

Gauges and the prefix-cache counters are read from the backend's `stats()` at scrape
time; request counters and latency histograms are recorded as requests finish.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from sage_infer.core.outputs import RequestOutput
from sage_infer.interfaces.backend import InferenceBackend

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def _spec_decode_families(stats, labels: list[str], value: list[str]):
    """Speculative decoding, as vLLM's `vllm:spec_decode_*` counters: mean accepted length is
    1 + accepted_tokens / drafts, acceptance rate accepted_tokens / draft_tokens."""
    families = []
    for name, help_text, count in (
            ("num_drafts", "Groups of proposed tokens verified (one per sequence and step).", stats.spec_drafts),
            ("num_draft_tokens", "Proposed tokens verified.", stats.spec_draft_tokens),
            ("num_accepted_tokens", "Proposed tokens the model agreed with.", stats.spec_accepted_tokens)):
        family = CounterMetricFamily(f"sage:spec_decode_{name}", help_text, labels=labels)
        family.add_metric(value, count)
        families.append(family)
    by_position = CounterMetricFamily("sage:spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, by "
                                      "their position in the proposal (0 = the first).", labels=[*labels, "position"])
    for position, count in enumerate(stats.spec_accepted_per_position):
        by_position.add_metric([*value, str(position)], count)
    return [*families, by_position]


def _prefetch_families(stats, labels: list[str], value: list[str]):
    """Prefetch hit ratio and wasted bandwidth, by kind: `queued` (a queued request's lower-tier prefix read
    ahead) and `hot` (hot blocks promoted into free device blocks ahead of need)."""
    by_kind = [*labels, "kind"]
    ratio = GaugeMetricFamily("sage:kv_prefetch_hit_ratio", "Prefetches a request used before they were evicted "
                              "or timed out, divided by prefetches issued (0 before the first).", labels=by_kind)
    moved = CounterMetricFamily("sage:kv_prefetch_bytes", "Bytes prefetches moved out of the lower tiers.",
                                labels=by_kind)
    wasted = CounterMetricFamily("sage:kv_prefetch_wasted_bytes", "Bytes prefetches moved that no request used "
                                 "(timed out, dropped, evicted first, or read past what admission took).",
                                 labels=by_kind)
    hot_wasted_bytes = stats.hot_wasted * stats.block_bytes
    for kind, issued, used, moved_bytes, wasted_bytes in (
            ("queued", stats.prefetch_issued, stats.prefetch_used, stats.prefetch_bytes, stats.prefetch_wasted_bytes),
            ("hot", stats.hot_promoted, stats.hot_used, stats.hot_promoted * stats.block_bytes, hot_wasted_bytes)):
        ratio.add_metric([*value, kind], used / issued if issued else 0.0)
        moved.add_metric([*value, kind], moved_bytes)
        wasted.add_metric([*value, kind], wasted_bytes)
    return [ratio, moved, wasted]


class _EngineCollector:
    """Reads live backend stats on every scrape (no background polling)."""

    def __init__(self, backend: InferenceBackend, model_name: str) -> None:
        self.backend = backend
        self.model_name = model_name

    def collect(self):
        labels = ["model_name"]
        value = [self.model_name]
        stats = self.backend.stats()
        running = GaugeMetricFamily("sage:num_requests_running", "Requests in the running batch.", labels=labels)
        running.add_metric(value, stats.num_running)
        waiting = GaugeMetricFamily("sage:num_requests_waiting", "Requests waiting to be scheduled.", labels=labels)
        waiting.add_metric(value, stats.num_waiting)
        usage = GaugeMetricFamily("sage:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", labels=labels)
        usage.add_metric(value, stats.kv_usage)
        queries = CounterMetricFamily("sage:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels=labels)
        hits = CounterMetricFamily("sage:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   labels=labels)
        lower = CounterMetricFamily("sage:prefix_cache_lower_hits", "Prompt tokens loaded from a lower KV tier "
                                    "(host, disk, remote) instead of computed; not in prefix_cache_hits.",
                                    labels=labels)
        same_step = CounterMetricFamily("sage:prefix_cache_same_step_hits", "Prompt tokens taken from blocks another "
                                        "request computed in the same step (requests behind one new prefix compute "
                                        "it once); not in prefix_cache_hits.", labels=labels)
        queries.add_metric(value, stats.prefix_query_tokens)
        hits.add_metric(value, stats.prefix_hit_tokens)
        lower.add_metric(value, stats.prefix_lower_hit_tokens)
        same_step.add_metric(value, stats.prefix_same_step_tokens)
        failures = CounterMetricFamily("sage:request_engine_failures", "Requests failed alone on an unexpected "
                                       "engine error (the engine went on serving the others).", labels=labels)
        failures.add_metric(value, stats.request_failures)
        preemptions = CounterMetricFamily("sage:num_preemptions", "Running requests sent back to wait with their KV "
                                          "freed (recomputed or reloaded later) to make room.", labels=labels)
        preemptions.add_metric(value, stats.num_preemptions)
        yield from _spec_decode_families(stats, labels, value)
        yield from self._tiers(stats, labels, value)
        yield from self._quotas(stats, labels, value)
        yield from _transfer_families(stats, labels, value)
        if stats.moe_expert_tokens:
            experts = CounterMetricFamily("sage:moe_expert_tokens", "Tokens routed to each expert of each "
                                          "mixture-of-experts layer (a token counts once per expert of its top-k).",
                                          labels=[*labels, "layer", "expert"])
            for layer, expert, n in stats.moe_expert_tokens:
                experts.add_metric([*value, str(layer), str(expert)], n)
            yield experts
        yield from (running, waiting, usage, queries, hits, lower, same_step, failures, preemptions)

    @staticmethod
    def _tiers(stats, labels: list[str], value: list[str]):
        """Lower KV tiers (none without `tiers:` config): size, traffic per direction, failures, up/down."""
        if not stats.tiers:
            return
        by_tier = [*labels, "tier"]
        families = {
            "blocks": GaugeMetricFamily("sage:kv_tier_blocks", "KV blocks held by the tier.", labels=by_tier),
            "bytes": GaugeMetricFamily("sage:kv_tier_bytes", "Bytes of KV held by the tier.", labels=by_tier),
            "capacity": GaugeMetricFamily("sage:kv_tier_capacity_bytes", "Capacity of the tier.", labels=by_tier),
            "up": GaugeMetricFamily("sage:kv_tier_up", "1 when the tier is used, 0 while it rests after a failure.",
                                    labels=by_tier),
            "errors": CounterMetricFamily("sage:kv_tier_errors", "Calls to the tier that failed.", labels=by_tier),
            "corrupt": CounterMetricFamily("sage:kv_tier_checksum_failures", "Blocks read back with a bad CRC32C.",
                                           labels=by_tier),
        }
        moved = CounterMetricFamily("sage:kv_tier_migrated_blocks", "Blocks moved between the device and a tier.",
                                    labels=[*by_tier, "direction"])
        moved_bytes = CounterMetricFamily("sage:kv_tier_migrated_bytes", "Bytes moved between the device and a tier.",
                                          labels=[*by_tier, "direction"])
        block_bytes = stats.block_bytes
        for tier in stats.tiers:
            at = [*value, tier.name]
            families["blocks"].add_metric(at, tier.blocks)
            families["bytes"].add_metric(at, tier.bytes)
            families["capacity"].add_metric(at, tier.capacity_bytes)
            families["up"].add_metric(at, 1 if tier.up else 0)
            families["errors"].add_metric(at, tier.errors)
            families["corrupt"].add_metric(at, tier.checksum_failures)
            for direction, blocks in (("demote", tier.demoted_blocks), ("load", tier.loaded_blocks),
                                      ("write_through", tier.written_through_blocks)):
                moved.add_metric([*at, direction], blocks)
                moved_bytes.add_metric([*at, direction], blocks * block_bytes)
        dropped = CounterMetricFamily("sage:kv_tier_dropped_blocks", "Evicted blocks that no tier kept.",
                                      labels=labels)
        dropped.add_metric(value, stats.tier_dropped_blocks)
        failures = CounterMetricFamily("sage:kv_tier_load_failures",
                                       "Blocks found in a tier but not returned verified (recomputed), by reason "
                                       "(miss, corrupt, error, timeout; recompute: computing was measured faster).",
                                       labels=[*labels, "reason"])
        for reason, count in stats.tier_load_failure_reasons:
            failures.add_metric([*value, reason], count)
        latency = HistogramMetricFamily("sage:kv_tier_load_latency_seconds", "Wall time of one lower-tier read "
                                        "(a request's whole lower-tier prefix).", labels=labels)
        latency.add_metric(value, [(floatToGoString(bound), n) for bound, n in stats.tier_load_latency],
                           sum_value=stats.tier_load_latency_sum)
        hot = CounterMetricFamily("sage:kv_tier_hot_promotions", "Hot blocks loaded back into free device blocks "
                                  "ahead of need, and those a later request hit.", labels=[*labels, "outcome"])
        hot.add_metric([*value, "promoted"], stats.hot_promoted)
        hot.add_metric([*value, "used"], stats.hot_used)
        hot.add_metric([*value, "wasted"], stats.hot_wasted)
        prefetch = CounterMetricFamily("sage:kv_tier_prefetch", "Lower-tier loads started for queued requests, "
                                       "by outcome (issued, used; wasted: timeout, dropped, evicted).",
                                       labels=[*labels, "outcome"])
        for outcome, count in (("issued", stats.prefetch_issued), ("used", stats.prefetch_used),
                               *stats.prefetch_wasted):
            prefetch.add_metric([*value, outcome], count)
        yield from (*families.values(), moved, moved_bytes, dropped, failures, latency, hot, prefetch)
        yield from _prefetch_families(stats, labels, value)
        yield from _load_or_compute_families(stats, labels, value)

    @staticmethod
    def _quotas(stats, labels: list[str], value: list[str]):
        """Tenant quotas (none configured: nothing): blocks held per tier, violations, self-evictions."""
        if not stats.quota_blocks and not stats.quota_events:
            return
        at = [*labels, "tier", "tenant"]
        held = GaugeMetricFamily("sage:kv_tenant_blocks", "KV blocks a tenant holds in a tier.", labels=at)
        for tier, tenant, n in stats.quota_blocks:
            held.add_metric([*value, tier, tenant], n)
        violations = CounterMetricFamily("sage:kv_quota_violations", "Evictions that broke a tenant's share: min "
                                         "(a tenant at its minimum lost a block), max (one over its maximum grew "
                                         "with none of its own blocks to evict).", labels=[*at, "kind"])
        own = CounterMetricFamily("sage:kv_quota_self_evictions", "Blocks a tenant over its maximum share evicted "
                                  "from its own.", labels=at)
        for tier, tenant, kind, n in stats.quota_events:
            if kind == "self_evict":
                own.add_metric([*value, tier, tenant], n)
            else:
                violations.add_metric([*value, tier, tenant, kind], n)
        yield from (held, violations, own)


def _load_or_compute_families(stats, labels: list[str], value: list[str]):
    """What load-or-compute measured and prices a tier hit with (each only once measured): a tier's block is loaded
    where reading it beats computing it at the step line's marginal rate."""
    if stats.tier_read_bytes_per_s:
        reads = GaugeMetricFamily("sage:kv_tier_read_bytes_per_second", "Measured speed of the tier's reads (a "
                                  "moving average, probed at start).", labels=[*labels, "tier"])
        for tier, rate in stats.tier_read_bytes_per_s:
            reads.add_metric([*value, tier], rate)
        yield reads
    for name, help_text, measured in (
        ("sage:prefill_step_fixed_seconds", "Fitted fixed part of a prefill step (launches, host work): loading a "
         "prompt's blocks does not save it.", stats.prefill_step_fixed_s),
        ("sage:prefill_marginal_flops", "Fitted rate of a prefill step's work beyond its fixed part, FLOP/s (tokens/s "
         "without a model shape; +Inf: steps cost the same at every size).", stats.prefill_marginal_flops),
        ("sage:kv_tier_load_fixed_seconds", "Fitted engine time of one lower-tier load at admission, fixed part.",
         stats.tier_load_fixed_s),
        ("sage:kv_tier_load_block_seconds", "Fitted engine time of one lower-tier load at admission, per block.",
         stats.tier_load_block_s),
    ):
        if measured is not None:
            gauge = GaugeMetricFamily(name, help_text, labels=labels)
            gauge.add_metric(value, measured)
            yield gauge


def _transfer_families(stats, labels: list[str], value: list[str]):
    """Prefill/decode KV transfers (none without a role): count by outcome, bytes and seconds by direction."""
    if stats.kv_transfer_role is None:
        return
    count = CounterMetricFamily("sage:pd_transfers", "Prefill/decode KV transfers by direction and outcome.",
                                labels=[*labels, "direction", "outcome"])
    nbytes = CounterMetricFamily("sage:pd_transfer_bytes", "KV bytes moved by completed prefill/decode transfers.",
                                 labels=[*labels, "direction"])
    seconds = CounterMetricFamily("sage:pd_transfer_seconds", "Wall time of completed transfers (send: first "
                                  "chunk to last verified chunk; receive: from expecting the KV to its last "
                                  "chunk).", labels=[*labels, "direction"])
    convert = CounterMetricFamily("sage:pd_transfer_convert_seconds", "Time spent converting transferred KV "
                                  "between KV dtypes (send: into the wire's or the receiver's; receive: the "
                                  "wire's into this pool's).", labels=[*labels, "direction"])
    for direction, ok, failed, moved, spent, converting in stats.kv_transfers:
        count.add_metric([*value, direction, "ok"], ok)
        count.add_metric([*value, direction, "failed"], failed)
        nbytes.add_metric([*value, direction], moved)
        seconds.add_metric([*value, direction], spent)
        convert.add_metric([*value, direction], converting)
    expired = CounterMetricFamily("sage:pd_expired_holds", "Held prefill KV no decode instance took "
                                  "in time (freed).", labels=labels)
    expired.add_metric(value, stats.kv_transfer_expired_holds)
    mismatched = CounterMetricFamily("sage:pd_hash_mismatches", "Received transfers whose blocks' hashes differed "
                                     "from this prompt's (another salt, revision or prompt): the rest was "
                                     "computed.", labels=labels)
    mismatched.add_metric(value, stats.kv_transfer_hash_mismatches)
    yield from (count, nbytes, seconds, convert, expired, mismatched)


class ServerMetrics:
    def __init__(self, backend: InferenceBackend, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(_EngineCollector(backend, model_name))
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("sage:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("sage:generation_tokens", "Tokens generated.", labels, registry=r)
        self.request_success = Counter("sage:request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("sage:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sage:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("sage:e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("sage:request_queue_time_seconds", "Arrival to first scheduling.", labels,
                                    buckets=REQUEST_BUCKETS, registry=r)

    def record_tokens(self, itl_gaps: list[float]) -> None:
        for gap in itl_gaps:
            self.itl.labels(self.model_name).observe(gap)

    def record_finished(self, output: RequestOutput) -> None:
        """One finished request: token counts, finish reason per completion, latencies."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            self.generation_tokens.labels(name).inc(len(completion.token_ids))
            self.request_success.labels(name, completion.finish_reason or "unknown").inc()
        metrics = output.metrics
        if metrics.ttft is not None:
            self.ttft.labels(name).observe(metrics.ttft)
        if metrics.e2e_latency is not None:
            self.e2e.labels(name).observe(metrics.e2e_latency)
        if metrics.queue_time is not None:
            self.queue_time.labels(name).observe(metrics.queue_time)


class StatsLog:
    """The periodic line `sage llm serve` prints while it works, as vLLM's: throughput since the last line, load,
    KV use, prefix-cache hits, and speculative decoding's acceptance since the last line. `line()` returns None
    when nothing ran since the last one."""

    def __init__(self, metrics: ServerMetrics, backend: InferenceBackend) -> None:
        self.metrics, self.backend = metrics, backend
        self.last = self._totals(backend.stats())

    def _totals(self, stats) -> dict[str, float]:
        labels = {"model_name": self.metrics.model_name}
        get = self.metrics.registry.get_sample_value
        return {"time": time.monotonic(), "prompt": get("sage:prompt_tokens_total", labels) or 0.0,
                "generation": get("sage:generation_tokens_total", labels) or 0.0, "drafts": stats.spec_drafts,
                "draft_tokens": stats.spec_draft_tokens, "accepted": stats.spec_accepted_tokens}

    def line(self) -> str | None:
        stats = self.backend.stats()
        now = self._totals(stats)
        delta = {key: now[key] - self.last[key] for key in now}
        self.last = now
        if not (delta["prompt"] or delta["generation"] or stats.num_running or stats.num_waiting):
            return None
        seconds = max(delta["time"], 1e-9)
        parts = [f"{delta['prompt'] / seconds:.1f} prompt tok/s", f"{delta['generation'] / seconds:.1f} generation "
                 f"tok/s", f"running {stats.num_running}", f"waiting {stats.num_waiting}",
                 f"KV {100 * stats.kv_usage:.1f} %"]
        if stats.prefix_caching and stats.prefix_query_tokens:
            parts.append(f"prefix hits {100 * stats.prefix_hit_tokens / stats.prefix_query_tokens:.1f} %")
            if stats.prefix_lower_hit_tokens:
                parts.append(f"lower-tier hits {100 * stats.prefix_lower_hit_tokens / stats.prefix_query_tokens:.1f} %")
        if delta["drafts"]:
            parts.append(f"spec decode: acceptance {delta['accepted'] / max(delta['draft_tokens'], 1):.2f}, "
                         f"mean accepted length {1 + delta['accepted'] / delta['drafts']:.2f}")
        return "sage: " + ", ".join(parts)
