"""Per-tenant quotas: a tenant over its maximum share evicts its own blocks first, a tenant at its
minimum is not evicted for others, and what could not be honoured is counted.

Unit level on `LowerTier` (a tier below the device) and on the prefix index (the device), then a
real engine with two tenants told apart by `cache_salt`, and `/metrics` of a real server.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sage_infer import LLM, SamplingParams
from sage_infer.config.serve import KVPoolConfig, ModelConfig, QuotaConfig, SchedulerConfig, ServeConfig
from sage_infer.kv_policy import make_policy
from sage_infer.kv_policy.migration import BlockMeta, LowerTier
from sage_infer.kv_policy.quota import DEVICE, QuotaManager, TenantShare
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.prefix_reuse.index import PrefixReuseIndex
from tests.tiny_models import make_tiny_model

X, Y, Z = b"x" * 32, b"y" * 32, b"z" * 32


def key(tenant: bytes, i: int) -> bytes:
    return tenant[:1] * 31 + bytes([i])


def meta(tenant: bytes) -> BlockMeta:
    return BlockMeta(depth=0, parent=None, tokens=16, tenant=tenant)


def tier(quota: QuotaManager, capacity: int = 4) -> LowerTier:
    return LowerTier("host", capacity, make_policy("lru", capacity=capacity), quota)


def test_a_tenant_at_its_maximum_evicts_its_own_oldest_block_even_when_the_tier_has_room():
    quota = QuotaManager({X: TenantShare("x", max_share=0.5)})
    host = tier(quota, capacity=8)
    for i in range(4):
        assert host.insert(key(X, i), meta(X)) == []
    evicted = host.insert(key(X, 4), meta(X))
    assert [k for k, _ in evicted] == [key(X, 0)]
    assert quota.held("host", X) == 4 and len(host) == 4
    assert quota.self_evictions["host", "x"] == 1


def test_a_full_tier_evicts_a_tenant_above_its_minimum_not_one_at_it():
    quota = QuotaManager({Y: TenantShare("y", min_share=0.5)})
    host = tier(quota)
    host.insert(key(Y, 0), meta(Y))  # the oldest blocks are Y's: plain LRU would take them
    host.insert(key(Y, 1), meta(Y))
    host.insert(key(Z, 0), meta(Z))
    host.insert(key(Z, 1), meta(Z))
    evicted = host.insert(key(Z, 2), meta(Z))
    assert [k for k, _ in evicted] == [key(Z, 0)]  # Y holds its minimum (2 of 4): Z's oldest goes
    assert quota.held("host", Y) == 2
    assert not quota.violations


def test_a_block_over_someone_elses_maximum_goes_before_a_fair_one():
    quota = QuotaManager({X: TenantShare("x", max_share=0.25)})
    host = tier(quota)
    host.insert(key(Z, 0), meta(Z))
    host.insert(key(X, 0), meta(X))
    quota.tiers["host"].capacity_blocks = 2  # shrink the share: X (1 block) is now over 0.25 * 2
    host.capacity_blocks = 2
    evicted = host.insert(key(Z, 1), meta(Z))
    assert [k for k, _ in evicted] == [key(X, 0)]  # not Z's older block


def test_when_only_protected_blocks_are_left_the_minimum_breaks_and_is_counted():
    quota = QuotaManager({Y: TenantShare("y", min_share=1.0)})
    host = tier(quota, capacity=2)
    host.insert(key(Y, 0), meta(Y))
    host.insert(key(Y, 1), meta(Y))
    evicted = host.insert(key(Z, 0), meta(Z))
    assert [k for k, _ in evicted] == [key(Y, 0)]
    assert quota.violations["host", "y", "min"] == 1


def test_the_device_follows_the_shares_of_whoever_needs_room():
    quota = QuotaManager({X: TenantShare("x", max_share=0.5)})
    quota.add_tier(DEVICE, 4)
    index = PrefixReuseIndex(2, make_policy("lru", capacity=4))
    index.quota = quota
    manager = BlockManager(4, 2, index)
    for tenant, token in [(Z, 1), (X, 2), (X, 3), (X, 4)]:  # one cached single-block prompt each
        [block_id] = manager.allocate(1, tenant)
        manager.cache_block(block_id, None, [token, token], tenant)
        manager.free([block_id])
    assert quota.held(DEVICE, X) == 3 and quota.held(DEVICE, Z) == 1  # cached blocks count
    [taken] = manager.allocate(1, X)  # X is over its half: it loses its own (oldest) block, not Z's
    assert quota.self_evictions[DEVICE, "x"] == 1 and quota.held(DEVICE, Z) == 1
    manager.free([taken])  # an unregistered block back on the free list no longer counts
    assert quota.held(DEVICE, X) == 2
    manager.allocate(2, Z)  # Z needs room, X is at (not over) its half: plain LRU, Z's own block goes first
    assert quota.held(DEVICE, Z) == 2 and quota.held(DEVICE, X) == 2
    manager.check_invariants()


def test_quota_config_rejects_inconsistent_shares():
    with pytest.raises(ValidationError, match="min_share"):
        QuotaConfig(tenants=[{"name": "a", "cache_salt": "s", "min_share": 0.6, "max_share": 0.5}])
    with pytest.raises(ValidationError, match="add up"):
        QuotaConfig(tenants=[{"name": "a", "cache_salt": "s", "min_share": 0.6},
                             {"name": "b", "cache_salt": "t", "min_share": 0.6}])
    with pytest.raises(ValidationError, match="same cache_salt"):
        QuotaConfig(tenants=[{"name": "a", "cache_salt": "s"}, {"name": "b", "cache_salt": "s"}])
    with pytest.raises(ValueError, match="min_share"):
        TenantShare("a", min_share=0.5, max_share=0.4)


# -- a real engine, two tenants ------------------------------------------------------------------

BLOCK = 16
GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def prompt(seed: int) -> list[int]:
    return [5 + (seed * 37 + 11 * j) % 500 for j in range(5 * BLOCK + 1)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("quota") / "model", "llama")


def make_llm(model_dir, quota: dict | None) -> LLM:
    config = ServeConfig(
        model=ModelConfig(path=str(model_dir), dtype="fp32"),
        kv_pool=KVPoolConfig(block_size=BLOCK, num_blocks=12),
        scheduler=SchedulerConfig(max_num_seqs=1),
        quota=QuotaConfig(**quota) if quota else QuotaConfig(),
    )
    return LLM(config=config, device="cpu")


def cached(llm: LLM, tokens: list[int], salt: str) -> tuple[list[int], int]:
    [out] = llm.generate([tokens], GREEDY, cache_salt=salt)
    return out.outputs[0].token_ids, out.metrics.num_cached_tokens


NOISY = {"name": "noisy", "cache_salt": "n-salt", "max_share": 0.25}


def test_a_noisy_tenant_over_its_share_evicts_its_own_prefixes_not_a_quiet_tenants(model_dir):
    quiet = prompt(1)
    plain = make_llm(model_dir, None)
    limited = make_llm(model_dir, {"tenants": [NOISY]})
    for llm in (plain, limited):
        cached(llm, quiet, "q-salt")  # 5 cached blocks of 12
        for seed in (2, 3):  # the noisy tenant's prompts need the room
            cached(llm, prompt(seed), "n-salt")
    cold = cached(plain, quiet, "other-salt")[0]
    assert cached(plain, quiet, "q-salt") == (cold, 0)  # LRU took the quiet tenant's (older) blocks
    assert cached(limited, quiet, "q-salt") == (cold, 5 * BLOCK)  # the noisy one paid from its own
    stats = limited.engine.stats()
    events = {(tier, tenant, kind): n for tier, tenant, kind, n in stats.quota_events}
    assert events[DEVICE, "noisy", "self_evict"] >= 4
    held = {(tier, tenant): n for tier, tenant, n in stats.quota_blocks}
    assert held[DEVICE, "other"] == 5  # the quiet tenant is not listed: it is "other"
    limited.engine.kv.block_manager.check_invariants()


def test_quotas_need_prefix_caching(model_dir):
    from sage_infer.errors import ConfigError

    config = ServeConfig(model=ModelConfig(path=str(model_dir), dtype="fp32"),
                         kv_pool=KVPoolConfig(block_size=BLOCK, num_blocks=12, enable_prefix_caching=False),
                         quota=QuotaConfig(tenants=[NOISY]))
    with pytest.raises(ConfigError, match="quota"):
        LLM(config=config, device="cpu")


def test_config_show_names_tenants_but_never_prints_a_salt(sage, tmp_path):
    config = tmp_path / "quota.yaml"
    config.write_text("quota:\n  tenants:\n    - {name: batch, cache_salt: topsecret, max_share: 0.25}\n")
    result = sage("config", "show", "--config", str(config), "--preset", "cpu")
    assert result.code == 0, result.err
    assert "batch" in result.out and "topsecret" not in result.out + result.err
    bad = tmp_path / "bad.yaml"
    bad.write_text("quota:\n  tenants:\n    - {name: batch, cache_salt: s, min_share: 0.5, max_share: 0.2}\n")
    result = sage("config", "show", "--config", str(bad), "--preset", "cpu")
    assert result.code == 2 and "quota.tenants" in result.err and len(result.err.strip().splitlines()) == 1
