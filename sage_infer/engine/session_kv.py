"""`SessionKV`: the KV a conversation's next turn will need, kept ahead of other traffic's (`kv_runtime.retention`).

A front end that keeps a conversation (the Responses API's stored responses) names, when a turn finishes, the turn's
whole context (prompt + generated tokens); the engine retains the device blocks holding it until the front end
releases the key or its TTL passes. On the engine's thread only (the native backend applies it between steps).
"""

from __future__ import annotations

from itertools import takewhile

from sage_infer.kv_runtime.group_kv_manager import GroupKVCacheManager
from sage_infer.kv_runtime.kv_cache_manager import KVCacheManager
from sage_infer.kv_runtime.retention import KVRetention
from sage_infer.prefix_reuse.hashing import ExtraKeys, hash_token_blocks


class SessionKV:
    """Retention of conversations' KV on one engine; off until `enable` (and always without prefix caching)."""

    def __init__(self, kv: KVCacheManager, extra_key: ExtraKeys) -> None:
        self._kv = kv
        self._extra_key = extra_key
        self.retention: KVRetention | None = None

    def enable(self, max_share: float) -> bool:
        """Retain at most `max_share` of the device pool's blocks at once; False without prefix caching."""
        manager = self._kv.block_manager
        if self._kv.index is None or not 0 < max_share <= 1:
            return False
        if self.retention is None:
            self.retention = manager.retention = KVRetention(int(manager.num_blocks * max_share))
            tiers = self._kv.source("tiers")
            for tier in tiers.hierarchy.migration.tiers if tiers is not None else ():
                tier.protected = self.retention.holds  # demoted retained blocks go last there too
        return True

    def retain(self, key: str, token_ids: list[int], cache_salt: str | None, ttl_s: float) -> int:
        """Retain the cached blocks of `token_ids` (tokens whose KV was computed) for `key`; how many blocks (the
        chain from the first block up to the first one no longer cached)."""
        if self.retention is None:
            return 0
        if isinstance(self._kv, GroupKVCacheManager):  # every KV group's blocks of the hit (a sliding one's window)
            return self.retention.retain(key, self._kv.cached_hashes(token_ids, self._extra_key(cache_salt)), ttl_s)
        index = self._kv.index
        hashes = hash_token_blocks(token_ids, self._kv.block_size, self._extra_key(cache_salt))
        chain = list(takewhile(lambda h: index.block_of(h) is not None, hashes))
        return self.retention.retain(key, chain, ttl_s)

    def release(self, key: str) -> bool:
        return self.retention.release(key) if self.retention is not None else False

    def stats(self) -> dict[str, int]:
        return self.retention.stats() if self.retention is not None else {}

    def registry(self):
        """A Prometheus registry of the retention's gauges and counters, read on every scrape (nothing while
        retention is off): ``sage:kv_retained_conversations``, ``sage:kv_retained_blocks``,
        ``sage:kv_retained_evicted_total`` (retained blocks evicted because nothing else was left),
        ``sage:kv_retention_dropped_total`` (retentions ended early to stay under the bound)."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sessions, model = self, self._extra_key.model_id

        class Collector:
            def collect(self):
                retention = sessions.retention
                if retention is None:
                    return
                for kind, name, text, value in (
                        (GaugeMetricFamily, "sage:kv_retained_conversations", "Conversations whose KV is retained "
                         "for their next turn (stored responses).", len(retention)),
                        (GaugeMetricFamily, "sage:kv_retained_blocks", "Device KV blocks retained (evicted last).",
                         retention.num_blocks),
                        (CounterMetricFamily, "sage:kv_retained_evicted", "Retained blocks evicted because "
                         "nothing else was left to evict.", retention.evicted_under_pressure),
                        (CounterMetricFamily, "sage:kv_retention_dropped", "Retentions ended early to stay under "
                         "responses.kv_share (the oldest first).", retention.dropped)):
                    family = kind(name, text, labels=["model_name"])
                    family.add_metric([model], value)
                    yield family

        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collector())
        return registry
