"""Lower KV tiers in the engine: an evicted block is demoted, a later prompt loads it back,
and whatever goes wrong below (corruption, a dead Redis) costs recompute, never a wrong token.

The device pool holds 8 blocks of 16 tokens; prompt A is 5 full blocks + 1 token. Two other
prompts of the same size then need the pool, which evicts A's cached blocks.
"""

from __future__ import annotations

import threading

import pytest

from sage_infer import LLM, SamplingParams
from sage_infer.config.resolve import resolve_config
from sage_infer.config.serve import KVPoolConfig, ModelConfig, SchedulerConfig, ServeConfig, TierConfig
from sage_infer.core.sequence import Sequence
from sage_infer.prefix_reuse.hashing import hash_token_blocks, make_extra_key
from tests.redis_fixture import start_redis
from tests.tiny_models import make_tiny_model

BLOCK = 16
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def prompt(seed: int) -> list[int]:
    return [5 + (seed * 37 + 11 * j) % 500 for j in range(5 * BLOCK + 1)]


A, B, C = prompt(1), prompt(2), prompt(3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiers") / "model", "llama")


def make_llm(model_dir, device: str = "cpu", **tiers) -> LLM:
    config = ServeConfig(
        model=ModelConfig(path=str(model_dir), dtype="fp32"),
        kv_pool=KVPoolConfig(block_size=BLOCK, num_blocks=8),
        scheduler=SchedulerConfig(max_num_seqs=1),
        tiers=TierConfig(**tiers),
    )
    return LLM(config=config, device=device)


def run(llm: LLM, tokens: list[int]):
    [out] = llm.generate([tokens], GREEDY)
    return out.outputs[0].token_ids, out.metrics.num_cached_tokens


@pytest.fixture(scope="module")
def cold(model_dir):
    """A's tokens from an engine that never saw it."""
    return run(make_llm(model_dir), A)[0]


def test_without_tiers_an_evicted_prompt_is_recomputed(model_dir, cold):
    llm = make_llm(model_dir)
    for tokens in (A, B, C):
        run(llm, tokens)
    assert run(llm, A) == (cold, 0)


def test_an_evicted_prompt_comes_back_from_the_host_tier(model_dir, cold):
    llm = make_llm(model_dir, host_bytes=1 << 20)
    for tokens in (A, B, C):
        run(llm, tokens)
    hierarchy = llm.engine.kv.source("tiers").hierarchy
    assert hierarchy.stats.demoted_blocks >= 5
    tokens, cached = run(llm, A)
    assert tokens == cold
    assert cached == 5 * BLOCK
    assert hierarchy.stats.tiers["host"].loaded_blocks == 5
    assert llm.engine.stats().prefix_lower_hit_tokens == 5 * BLOCK  # (prefix_hit_tokens: the device's alone)
    assert hierarchy.stores[0].stats().blocks == hierarchy.stats.demoted_blocks - 5  # exclusive: loaded ones left
    llm.engine.kv.block_manager.check_invariants()


def test_a_corrupt_block_in_the_host_tier_is_recomputed(model_dir, cold):
    llm = make_llm(model_dir, host_bytes=1 << 20)
    for tokens in (A, B, C):
        run(llm, tokens)
    host = llm.engine.kv.source("tiers").hierarchy.stores[0]
    engine = llm.engine
    keys = hash_token_blocks(A, BLOCK, make_extra_key(engine.model_id, engine.revision, engine.kv_dtype, "NHD"))
    assert host.drain(10)
    host.slab[host.slot_of(keys[2])][100] ^= 0xFF  # A's third block is wrong now
    tokens, cached = run(llm, A)
    assert tokens == cold
    assert cached == 2 * BLOCK  # the verified prefix: blocks 0 and 1
    assert host.stats().checksum_failures == 1
    assert llm.engine.kv.source("tiers").hierarchy.stats.failures["corrupt"] == 3  # blocks 2..4 were recomputed


def test_a_restarted_engine_hits_what_the_disk_tier_wrote(model_dir, cold, tmp_path):
    first = make_llm(model_dir, disk_path=str(tmp_path), disk_bytes=64 << 20)
    for tokens in (A, B, C):
        run(first, tokens)
    assert first.engine.kv.source("tiers").hierarchy.stats.tiers["disk"].demoted_blocks >= 5
    first.engine.kv.source("tiers").hierarchy.close()
    second = make_llm(model_dir, disk_path=str(tmp_path), disk_bytes=64 << 20)
    assert run(second, A) == (cold, 5 * BLOCK)


def test_two_engines_share_prefixes_through_redis(model_dir, cold):
    server = start_redis()
    try:
        writer = make_llm(model_dir, remote_url=server.url)
        for tokens in (A, B, C):
            run(writer, tokens)
        reader = make_llm(model_dir, remote_url=server.url)
        assert run(reader, A) == (cold, 5 * BLOCK)
        # the reader loaded A but left it in the shared tier: a third server hits it too
        third = make_llm(model_dir, remote_url=server.url)
        assert run(third, A) == (cold, 5 * BLOCK)
        redis = reader.engine.kv.source("tiers").hierarchy.stores[0]
        assert all(redis.contains(hash_token_blocks(A, BLOCK, _extra_key(reader))))
    finally:
        server.kill()


def test_a_redis_that_dies_mid_run_costs_recompute_not_requests(model_dir, cold):
    server = start_redis()
    try:
        llm = make_llm(model_dir, remote_url=server.url)
        for tokens in (A, B):
            run(llm, tokens)
        server.kill()
        for tokens in (C, B):  # evictions now fail to demote
            run(llm, tokens)
        assert run(llm, A) == (cold, 0)
        assert llm.engine.kv.source("tiers").hierarchy.stats.tiers["redis"].errors >= 1
        llm.engine.kv.block_manager.check_invariants()
    finally:
        server.kill()


def test_the_presets_cost_model_drops_blocks_that_load_slower_than_they_recompute(model_dir, tmp_path):
    slow = tmp_path / "slow-host.yaml"
    slow.write_text("extends: cpu\nname: slow-host\nhost_link:\n  bandwidth_gb_s: 0.000001\n")
    resolved = resolve_config(preset=str(slow), env={}, cli={
        "model": {"path": str(model_dir), "dtype": "fp32"}, "kv_pool": {"block_size": BLOCK, "num_blocks": 8},
        "scheduler": {"max_num_seqs": 1}, "tiers": {"host_bytes": 1 << 20}})
    llm = LLM(config=resolved.config, device="cpu")
    for tokens in (A, B, C):
        run(llm, tokens)
    hierarchy = llm.engine.kv.source("tiers").hierarchy
    assert hierarchy.stats.demoted_blocks == 0 and hierarchy.stats.dropped_blocks >= 5
    assert "-> drop" in hierarchy.describe()
    assert run(llm, A)[1] == 0


class HeldTier:
    """A real host tier whose reads wait until the test lets them go (a slow or stuck backend)."""

    def __init__(self, store) -> None:
        self.store = store
        self.release = threading.Event()
        self.started = threading.Event()  # a read reached the tier (the loader thread may start it late)
        self.reads = 0

    def get_prefix(self, keys, out=None):
        self.reads += 1
        self.started.set()
        self.release.wait()
        return self.store.get_prefix(keys, out)

    def __getattr__(self, name):
        return getattr(self.store, name)


def hold_host_tier(llm: LLM) -> HeldTier:
    hierarchy = llm.engine.kv.source("tiers").hierarchy
    held = HeldTier(hierarchy.stores[0])
    hierarchy.stores[0] = held
    return held


def test_a_request_loading_from_a_tier_waits_while_others_compute(model_dir, cold):
    llm = make_llm(model_dir, host_bytes=1 << 20)
    for tokens in (A, B, C):
        run(llm, tokens)
    held = hold_host_tier(llm)
    engine = llm.engine
    engine.add_request("a", A, GREEDY)  # its prefix is in the host tier: the read starts now and blocks
    engine.add_request("d", prompt(4), GREEDY)  # nothing cached: computes meanwhile
    finished: dict[str, object] = {}
    for _ in range(20):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if "d" in finished:
            break
    assert "d" in finished and "a" not in finished
    assert held.started.wait(timeout=30)  # on a busy machine the loader thread can be scheduled after d finished
    assert held.reads == 1 and engine.kv.is_loading(engine.requests["a"].seqs[0])
    held.release.set()
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["a"].outputs[0].token_ids == cold
    assert finished["a"].metrics.num_cached_tokens == 5 * BLOCK
    assert engine.kv.source("tiers").loader.stats.used == 1


def test_a_load_past_its_deadline_is_recomputed(model_dir, cold):
    llm = make_llm(model_dir, host_bytes=1 << 20, load_timeout_s=0.2)
    for tokens in (A, B, C):
        run(llm, tokens)
    held = hold_host_tier(llm)
    try:
        tokens, cached = run(llm, A)
    finally:
        held.release.set()
    assert tokens == cold and cached == 0
    assert llm.engine.kv.source("tiers").loader.stats.timeouts == 1
    assert llm.engine.kv.source("tiers").hierarchy.stats.load_failures == 5


def test_remote_bytes_sizes_the_remote_tier(model_dir):
    server = start_redis()
    try:
        llm = make_llm(model_dir, remote_url=server.url, remote_bytes=64 << 10)
        hierarchy = llm.engine.kv.source("tiers").hierarchy
        block = llm.engine.runner.pool.block_nbytes
        assert hierarchy.stores[0].capacity_bytes == 64 << 10
        assert hierarchy.migration.tiers[0].capacity_blocks == (64 << 10) // block
    finally:
        server.kill()


def test_a_hot_block_is_promoted_into_free_device_blocks_before_it_is_asked_for(model_dir, cold):
    llm = make_llm(model_dir, host_bytes=1 << 20)  # hot after 2 loads (the default)
    hierarchy, kv = llm.engine.kv.source("tiers").hierarchy, llm.engine.kv
    for _ in range(2):  # A comes back from the host tier twice: hot (B and C once each)
        for tokens in (A, B, C):
            run(llm, tokens)
        assert run(llm, A) == (cold, 5 * BLOCK)
    kv.block_manager.reset_prefix_cache()  # every cached block goes down to the host tier: the pool is free
    run(llm, [9] * (BLOCK + 1))  # the steps of an unrelated short prompt promote A's chain, top first
    hot = hierarchy.migrator.stats
    assert hot.hot_promoted == 5
    assert [kv.index.block_of(k) is not None for k in hash_token_blocks(A, BLOCK, _extra_key(llm))] == [True] * 5
    loaded = hierarchy.stats.tiers["host"].loaded_blocks
    assert run(llm, A) == (cold, 5 * BLOCK)  # every block on the device already: nothing to load
    assert hierarchy.stats.tiers["host"].loaded_blocks == loaded
    assert hot.hot_used == 5
    kv.block_manager.check_invariants()


def test_hot_promotion_can_be_turned_off(model_dir, cold):
    llm = make_llm(model_dir, host_bytes=1 << 20, hot_promote_after=0)
    for _ in range(3):
        for tokens in (A, B, C):
            run(llm, tokens)
        assert run(llm, A) == (cold, 5 * BLOCK)
    assert llm.engine.kv.source("tiers").hierarchy.migrator.stats.hot_promoted == 0


def _extra_key(llm: LLM) -> bytes:
    engine = llm.engine
    return make_extra_key(engine.model_id, engine.revision, engine.kv_dtype, "NHD")


def test_a_waiting_request_asks_the_lower_tiers_once_not_every_step(model_dir):
    llm = make_llm(model_dir, host_bytes=1 << 20)
    for tokens in (A, B, C):
        run(llm, tokens)
    kv = llm.engine.kv
    host = kv.source("tiers").hierarchy.stores[0]
    calls = []
    contains = host.contains
    host.contains = lambda keys: calls.append(len(keys)) or contains(keys)
    now = [100.0]
    kv.clock = lambda: now[0]
    waiting = Sequence(seq_id=10_000, request_id="w", index=0, token_ids=list(A), num_prompt_tokens=len(A),
                       params=GREEDY, extra_key=_extra_key(llm))
    for _ in range(5):  # five scheduling steps while it waits
        assert len(kv.match(waiting).lower_block_hashes) == 5
    assert len(calls) == 1
    now[0] += 1.0  # past LOWER_LOOKUP_TTL_S: asked again
    assert len(kv.match(waiting).lower_block_hashes) == 5
    assert len(calls) == 2


def test_a_graceful_close_keeps_the_device_and_host_blocks_in_the_disk_tier_for_a_restart(model_dir, cold, tmp_path):
    """Tiers are exclusive while serving: a prompt whose blocks sit on the device or in the host tier is not on
    disk. Closing the engine copies them there (and syncs), so a restart on the same directory finds them."""
    disk = tmp_path / "kv"
    first = make_llm(model_dir, host_bytes=1 << 20, disk_path=str(disk), disk_bytes=64 << 20)
    for tokens in (A, B, C):
        run(first, tokens)
    disk_counters = first.engine.kv.source("tiers").hierarchy.stats.tiers["disk"]
    assert disk_counters.demoted_blocks == 0  # everything fit above the disk
    first.close()
    second = make_llm(model_dir, disk_path=str(disk), disk_bytes=64 << 20)  # (no host tier this time)
    for tokens in (A, B, C):
        assert run(second, tokens)[1] == 5 * BLOCK
    assert run(second, A)[0] == cold
    second.close()


def _crash(llm: LLM) -> None:
    """What a crash leaves on disk: the writes the disk tier's writer finished (no graceful persist)."""
    disk = next(store for store in llm.engine.kv.source("tiers").hierarchy.stores if store.persistent)
    disk.flush()
    disk.close()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_write_through_puts_what_the_device_computed_on_disk_before_any_eviction(model_dir, cold, tmp_path, policy):
    """With a host tier above the disk, write-back leaves a crash nothing on disk; write-through has every block
    the device computed there at once, and keeps that copy when the block is loaded back or computed again."""
    disk = tmp_path / "kv"
    first = make_llm(model_dir, host_bytes=1 << 20, disk_path=str(disk), disk_bytes=64 << 20, write_policy=policy)
    run(first, A)
    counters = first.engine.kv.source("tiers").hierarchy.stats.tiers["disk"]
    assert counters.written_through_blocks == (5 if policy == "write_through" else 0)
    for tokens in (B, C, A):
        run(first, tokens)
    first.engine.kv.block_manager.check_invariants()
    assert counters.demoted_blocks == 0  # (the host tier took every eviction)
    _crash(first)
    second = make_llm(model_dir, disk_path=str(disk), disk_bytes=64 << 20)
    assert run(second, A) == (cold, 5 * BLOCK if policy == "write_through" else 0)
    second.close()


def test_write_through_selective_copies_a_block_on_its_second_hit(model_dir, cold, tmp_path):
    disk = tmp_path / "kv"
    first = make_llm(model_dir, disk_path=str(disk), disk_bytes=64 << 20, write_policy="write_through_selective")
    counters = first.engine.kv.source("tiers").hierarchy.stats.tiers["disk"]
    run(first, A)  # computed
    run(first, A)  # first hit
    assert counters.written_through_blocks == 0
    run(first, A)  # second hit: copied
    assert counters.written_through_blocks == 5
    run(first, B)  # computed once, never hit: stays off the disk
    assert counters.written_through_blocks == 5
    _crash(first)
    second = make_llm(model_dir, disk_path=str(disk), disk_bytes=64 << 20)
    assert run(second, A) == (cold, 5 * BLOCK)
    assert run(second, B)[1] == 0
    second.close()


def test_a_write_policy_other_than_write_back_needs_a_disk_tier():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="write_policy write_through writes blocks to the disk tier"):
        TierConfig(host_bytes=1 << 20, write_policy="write_through")


def test_a_prompt_is_hashed_once_from_its_lookups_through_its_load_and_registration(model_dir, cold, monkeypatch):
    """The device match of every step it waits, the tiers' lookup and the loaded blocks' registration share one
    chain of hashes per sequence."""
    from sage_infer.prefix_reuse import hashing

    llm = make_llm(model_dir, host_bytes=1 << 20)
    for tokens in (A, B, C):
        run(llm, tokens)
    calls = []
    real = hashing.hash_block
    monkeypatch.setattr(hashing, "hash_block", lambda *a: calls.append(a[1]) or real(*a))
    tokens, cached = run(llm, A)
    assert (tokens, cached) == (cold, 5 * BLOCK)
    assert llm.engine.kv.source("tiers").hierarchy.stats.tiers["host"].loaded_blocks == 5
    assert [list(block) for block in calls] == [A[i * BLOCK : (i + 1) * BLOCK] for i in range(5)]
