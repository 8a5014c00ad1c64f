"""KV tiers seen from the server: /metrics reports them, a dead remote tier degrades /health
but every request still succeeds (by recompute)."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sage_infer.config.serve import QuotaConfig, TierConfig
from tests.redis_fixture import start_redis
from tests.server_fixture import running_server
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("server-tiers") / "tiny-llama", "llama")


def samples(url: str) -> dict[tuple[str, str, str], float]:
    """(sample name, tier, direction or outcome) -> value for the sage:kv_tier_* families."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name.startswith("sage:kv_tier"):
                label = s.labels.get("direction", s.labels.get("outcome", s.labels.get("reason",
                                                                                        s.labels.get("le", ""))))
                out[s.name, s.labels.get("tier", ""), label] = s.value
    return out


def complete(client: openai.OpenAI, model: str, seed: int, salt: str | None = None) -> str:
    prompt = [5 + (seed * 37 + 11 * j) % 500 for j in range(81)]
    extra = {"ignore_eos": True} if salt is None else {"ignore_eos": True, "cache_salt": salt}
    out = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
    return out.choices[0].finish_reason


def test_metrics_report_demotions_and_a_dead_redis_degrades_health_only(model_dir):
    redis = start_redis()
    try:
        with running_server(model_dir, num_blocks=8, max_num_seqs=1,
                            tiers=TierConfig(host_bytes=1 << 20, remote_url=redis.url)) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            for seed in (1, 2, 3):
                assert complete(client, server.model, seed) == "length"
            before = samples(server.url)
            assert before["sage:kv_tier_migrated_blocks_total", "host", "demote"] >= 5
            assert before["sage:kv_tier_capacity_bytes", "host", ""] == 1 << 20
            assert before["sage:kv_tier_up", "redis", ""] == 1
            assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}

            redis.kill()
            assert complete(client, server.model, 1) == "length"  # its blocks were demoted: a prefetched hit
            prefetched = samples(server.url)
            assert prefetched["sage:kv_tier_prefetch_total", "", "issued"] >= 1
            assert prefetched["sage:kv_tier_prefetch_total", "", "used"] >= 1
            assert prefetched["sage:kv_tier_migrated_blocks_total", "host", "load"] >= 1
            counters = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics")
                                                                                 .text) for s in f.samples}
            assert counters["sage:prefix_cache_lower_hits_total"] == (  # the prompt tokens those loads brought
                16 * prefetched["sage:kv_tier_migrated_blocks_total", "host", "load"])
            assert prefetched["sage:kv_tier_load_latency_seconds_count", "", ""] >= 1
            assert prefetched["sage:kv_tier_load_latency_seconds_bucket", "", "+Inf"] >= 1

            for seed in (4, 5, 6, 7, 1):  # host overflows into the dead remote tier
                assert complete(client, server.model, seed) == "length"
            after = samples(server.url)
            health = httpx.get(f"{server.url}/health")
            assert health.status_code == 200 and health.json()["status"] == "degraded"
            assert "redis" in health.json()["degraded"]
            assert after["sage:kv_tier_up", "redis", ""] == 0
            assert after["sage:kv_tier_errors_total", "redis", ""] >= 1
    finally:
        redis.kill()


def test_metrics_report_what_load_or_compute_measured(model_dir):
    with running_server(model_dir, num_blocks=8, max_num_seqs=1, tiers=TierConfig(host_bytes=1 << 20)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        gauges = {s.name: s for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
                  for s in f.samples}
        # measured at start, before any request: the host tier's read probe and the prefill steps of 16-128 tokens
        read = gauges["sage:kv_tier_read_bytes_per_second"]
        assert read.labels["tier"] == "host" and read.value > 0
        assert gauges["sage:prefill_step_fixed_seconds"].value >= 0
        assert gauges["sage:prefill_marginal_flops"].value > 0
        assert "sage:kv_tier_load_fixed_seconds" not in gauges  # no load yet
        for seed in (1, 2, 3, 1):  # 1's blocks went down to the host tier, then come back
            assert complete(client, server.model, seed) == "length"
        after = samples(server.url)
        gauges = {s.name: s.value for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
                  for s in f.samples}
        loads = after.get(("sage:kv_tier_migrated_blocks_total", "host", "load"), 0)
        recomputed = after.get(("sage:kv_tier_load_failures_total", "", "recompute"), 0)
        assert loads + recomputed >= 5  # its 5 blocks: loaded, or measured cheaper to compute
        if loads:  # a load's own engine time is measured once one happened
            assert gauges["sage:kv_tier_load_fixed_seconds"] > 0 and gauges["sage:kv_tier_load_block_seconds"] >= 0


def test_a_disk_tier_whose_directory_is_deleted_is_counted_rested_and_made_again(model_dir, tmp_path):
    """Deleting the disk tier's directory while serving: the next writes fail over to a new directory, and the
    loss shows in `sage:kv_tier_errors_total`, `sage:kv_tier_up` and /health."""
    import shutil
    import time

    directory = tmp_path / "kv-disk"
    with running_server(model_dir, num_blocks=8, max_num_seqs=1,
                        tiers=TierConfig(disk_path=str(directory), disk_bytes=64 << 20)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        for seed in (1, 2, 3):
            assert complete(client, server.model, seed) == "length"
        stores = server.backend.engine.kv.source("tiers").hierarchy.stores
        stores[0].flush()
        before = samples(server.url)
        assert before["sage:kv_tier_blocks", "disk", ""] >= 5 and before["sage:kv_tier_up", "disk", ""] == 1
        assert before["sage:kv_tier_errors_total", "disk", ""] == 0

        shutil.rmtree(directory)
        for seed in (4, 5, 6):  # more demotions: the writer finds the directory gone
            assert complete(client, server.model, seed) == "length"
        stores[0].flush()
        deadline = time.monotonic() + 10
        while samples(server.url)["sage:kv_tier_up", "disk", ""] == 1:
            assert time.monotonic() < deadline, "the deleted directory was never reported"
            time.sleep(0.05)
        after = samples(server.url)
        assert after["sage:kv_tier_errors_total", "disk", ""] >= 1
        health = httpx.get(f"{server.url}/health").json()
        lost = int(before["sage:kv_tier_blocks", "disk", ""])
        assert health["status"] == "degraded"
        assert "disappeared" in health["degraded"]["disk"] and f"the {lost} blocks" in health["degraded"]["disk"]
        # what the gauge says now is what the new directory holds (the writes after the loss)
        assert after["sage:kv_tier_blocks", "disk", ""] == len(stores[0]._index)
        assert directory.is_dir()  # made again: later demotions land there once the tier's rest is over
        assert complete(client, server.model, 1) == "length"  # serving stayed correct meanwhile


def test_a_disk_tier_that_cannot_write_is_counted_and_rested(model_dir, tmp_path, monkeypatch):
    """A full disk (ENOSPC from the write, which a test cannot produce portably without a small filesystem to
    fill: the one place this test stands in for the OS) is counted and rests the tier; requests go on."""
    import errno
    import os
    import time

    from sage_infer.kv_runtime.tiers import disk

    with running_server(model_dir, num_blocks=8, max_num_seqs=1,
                        tiers=TierConfig(disk_path=str(tmp_path / "kv-disk"), disk_bytes=64 << 20)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        def full(*_args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(disk.os, "pwritev", full)
        for seed in (1, 2, 3, 4):
            assert complete(client, server.model, seed) == "length"
        server.backend.engine.kv.source("tiers").hierarchy.stores[0].flush()
        deadline = time.monotonic() + 10
        while samples(server.url)["sage:kv_tier_up", "disk", ""] == 1:
            assert time.monotonic() < deadline, "the failed writes were never reported"
            time.sleep(0.05)
        assert samples(server.url)["sage:kv_tier_errors_total", "disk", ""] >= 1
        health = httpx.get(f"{server.url}/health").json()
        assert health["status"] == "degraded" and "No space left on device" in health["degraded"]["disk"]


def tenant_samples(url: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if s.name.startswith(("sage:kv_tenant", "sage:kv_quota")):
                out[(s.name, s.labels["tier"], s.labels["tenant"], *([s.labels["kind"]] if "kind" in s.labels
                                                                       else []))] = s.value
    return out


def test_metrics_report_tenant_quotas(model_dir):
    quota = QuotaConfig(tenants=[{"name": "noisy", "cache_salt": "n-salt", "max_share": 0.25},
                                 {"name": "quiet", "cache_salt": "q-salt", "min_share": 0.5}])
    with running_server(model_dir, num_blocks=12, max_num_seqs=1, quota=quota) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        complete(client, server.model, 1, salt="q-salt")
        for seed in (2, 3):
            complete(client, server.model, seed, salt="n-salt")
        got = tenant_samples(server.url)
        assert got["sage:kv_tenant_blocks", "device", "quiet"] == 5
        assert got["sage:kv_quota_self_evictions_total", "device", "noisy"] >= 4
        assert "n-salt" not in httpx.get(f"{server.url}/metrics").text  # salts are secrets: names only
