"""Prefetch you can count: a queued request's lower-tier prefix read ahead is used (a hit) or wasted (timed out,
dropped, evicted), with the bytes it moved for nothing, in /metrics (parsed with prometheus_client) and in
the engine's counters; hot blocks promoted ahead of need and evicted unused count as wasted too."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sage_infer.config.serve import TierConfig
from tests.server_fixture import running_server
from tests.test_kv_tiers_engine import BLOCK, GREEDY, A, B, C, HeldTier, hold_host_tier, make_llm, prompt, run
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("prefetch") / "tiny-llama", "llama")


def scrape(url: str) -> dict[tuple[str, str], float]:
    """(sample name, outcome or kind) -> value of the prefetch families."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            if "prefetch" in s.name or s.name.startswith("sage:kv_tier_hot"):
                out[s.name, s.labels.get("outcome", s.labels.get("kind", ""))] = s.value
    return out


def complete(client: openai.OpenAI, model: str, tokens: list[int]) -> None:
    out = client.completions.create(model=model, prompt=tokens, max_tokens=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"


def test_a_used_and_a_timed_out_prefetch_in_metrics(model_dir):
    with running_server(model_dir, num_blocks=8, max_num_seqs=1,
                        tiers=TierConfig(host_bytes=1 << 20, load_timeout_s=2.0)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        engine = server.backend.engine
        block_bytes = engine.runner.pool.block_nbytes
        for tokens in (A, B, C):  # 5 full blocks each; 8 device blocks: A and B go down to the host tier
            complete(client, server.model, tokens)
        complete(client, server.model, A)  # queued with its prefix in the host tier: read ahead, then used
        hit = scrape(server.url)
        assert hit["sage:kv_tier_prefetch_total", "issued"] == hit["sage:kv_tier_prefetch_total", "used"] == 1
        assert hit["sage:kv_prefetch_hit_ratio", "queued"] == 1.0
        assert hit["sage:kv_prefetch_bytes_total", "queued"] == 5 * block_bytes
        assert hit["sage:kv_prefetch_wasted_bytes_total", "queued"] == 0

        hierarchy = engine.kv.source("tiers").hierarchy
        held = HeldTier(hierarchy.stores[0])
        hierarchy.stores[0] = held  # B's read blocks past its 2 s deadline: admission recomputes B instead
        try:
            complete(client, server.model, B)
        finally:
            held.release.set()
        assert held.reads == 1
        wasted = scrape(server.url)
        assert wasted["sage:kv_tier_prefetch_total", "issued"] == 2
        assert wasted["sage:kv_tier_prefetch_total", "timeout"] == 1 and wasted["sage:kv_tier_prefetch_total",
                                                                                "used"] == 1
        assert wasted["sage:kv_prefetch_hit_ratio", "queued"] == 0.5
        assert wasted["sage:kv_prefetch_bytes_total", "queued"] == 10 * block_bytes
        assert wasted["sage:kv_prefetch_wasted_bytes_total", "queued"] == 5 * block_bytes  # read, never used
        assert engine.stats().prefetch_wasted_bytes == 5 * block_bytes


def test_a_prefetch_whose_request_ends_first_is_dropped_and_its_bytes_wasted(model_dir):
    llm = make_llm(model_dir, host_bytes=1 << 20)
    for tokens in (A, B, C):
        run(llm, tokens)
    held = hold_host_tier(llm)
    engine = llm.engine
    engine.add_request("a", A, GREEDY)  # its prefix is in the host tier: the read starts, and blocks
    engine.abort_request("a")  # the request ends before admission took the blocks
    held.release.set()
    loads = engine.kv.source("tiers").loader.stats
    assert (loads.issued, loads.used, loads.dropped) == (1, 0, 1)
    assert loads.blocks_wasted == 5 and loads.hit_ratio == 0.0


def test_hot_blocks_promoted_and_evicted_before_any_request_hit_them_are_wasted(model_dir):
    llm = make_llm(model_dir, host_bytes=1 << 20)  # hot after 2 loads from below (the default)
    kv = llm.engine.kv
    for _ in range(2):
        for tokens in (A, B, C):
            run(llm, tokens)
        run(llm, A)
    kv.block_manager.reset_prefix_cache()  # everything goes down to the host tier: the pool is free
    run(llm, [9] * (BLOCK + 1))  # an unrelated prompt's steps promote A's hot chain into free device blocks
    hot = kv.source("tiers").hierarchy.migrator.stats
    assert hot.hot_promoted == 5
    for seed in (4, 5):  # other prompts need the room: A's promoted blocks are evicted, never hit
        run(llm, prompt(seed))
    stats = llm.engine.stats()  # (room freed later may promote some of them again: counted again)
    assert stats.hot_used == 0 and 1 <= stats.hot_wasted <= stats.hot_promoted
    migrator = kv.source("tiers").hierarchy.migrator
    assert len(migrator.promoted_ahead) == stats.hot_promoted - stats.hot_wasted  # the rest still wait on device

