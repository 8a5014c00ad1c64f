"""Tenant quotas across servers sharing one Redis or Mooncake Store tier: a tenant's maximum caps it in the whole
fleet."""

from __future__ import annotations

import pytest

from sage_infer.kv_policy import make_policy
from sage_infer.kv_policy.migration import BlockMeta, LowerTier
from sage_infer.kv_policy.quota import QuotaManager, TenantShare
from sage_infer.kv_runtime.tiers import RedisTier
from tests.redis_fixture import start_redis
from tests.test_kv_tiers import SCHEMA

X, Y = b"x" * 32, b"y" * 32
CAPACITY = 16  # blocks of the shared tier; X may hold a quarter: 4


@pytest.fixture(params=["redis", "mooncake"])
def server(request):
    if request.param == "redis":
        server = start_redis()
    else:
        from tests.mooncake_fixture import start_master

        server = start_master()
    yield server
    server.kill()


def shared_tier(url: str):
    if url.startswith("mooncake://"):
        from sage_infer.kv_runtime.tiers.mooncake import MooncakeTier

        return MooncakeTier(SCHEMA, url, capacity_bytes=1 << 20)
    return RedisTier(SCHEMA, url, capacity_bytes=1 << 20)


class Server:
    """One sage server's view of the shared tier: its store, quota and lower tier."""

    def __init__(self, url: str) -> None:
        self.store = shared_tier(url)
        self.quota = QuotaManager({X: TenantShare("x", max_share=0.25)})
        self.tier = LowerTier("remote", CAPACITY, make_policy("lru", capacity=CAPACITY), self.quota)
        self.shares = self.store.tenant_shares(lambda: self.quota.local_blocks("remote"))
        self.shares.refresh_s = 0.0  # read the others at every question (the default caches for 0.5 s)
        self.quota.share_fleet_wide("remote", self.shares)
        self.n = 0

    def store_block(self, tenant: bytes) -> None:
        self.n += 1
        self.tier.insert(tenant[:1] + self.n.to_bytes(31, "big"), BlockMeta(0, None, 16, tenant))

    def holds(self, tenant: bytes) -> int:
        return self.quota.local_blocks("remote").get(tenant, 0)


def test_a_tenants_maximum_of_a_shared_tier_holds_across_servers(server):
    a, b = Server(server.url), Server(server.url)
    for _ in range(4):
        a.store_block(X)  # X at its maximum through a alone
    for _ in range(6):
        b.store_block(X)  # b sees a's 4: it keeps one block of X (its own to evict for the next), not 6
        b.store_block(Y)
    assert a.holds(X) == 4 and b.holds(X) == 1  # within one block per server of the fleet-wide maximum
    assert b.quota.violations["remote", "x", "max"] == 1 and b.quota.self_evictions["remote", "x"] == 5
    assert b.holds(Y) == 6  # other tenants are not held back
    assert b.quota.held("remote", X) == 5 and a.quota.held("remote", X) == 5  # both count the fleet
    a.shares.close()  # a leaves (or its key expires): b may grow X to the whole maximum
    for _ in range(4):
        b.store_block(X)
    assert b.holds(X) == 4
    for s in (a, b):
        s.store.close()
    if server.url.startswith("mooncake://"):
        for s in (a, b):
            s.store.close(wait=True)  # before the master goes


def test_a_mooncake_server_that_stops_publishing_leaves_the_sum_after_the_ttl():
    """Mooncake Store keeps no expiry: a slot whose counts stop moving is dropped by its readers (Redis expires a
    server's key itself)."""
    from tests.mooncake_fixture import start_master

    server = start_master()
    a, b = Server(server.url), Server(server.url)
    clock = [0.0]
    b.shares.clock = lambda: clock[0]
    for _ in range(3):
        a.store_block(X)
    assert b.quota.held("remote", X) == 3
    clock[0] = b.shares.ttl_s - 1  # a publishes nothing more (its process hung, or died without leaving)
    assert b.quota.held("remote", X) == 3  # its counts, unchanged since b first read them, still count...
    clock[0] = b.shares.ttl_s + 1
    assert b.quota.held("remote", X) == 0  # ...until a TTL of silence: then they are out of the sum
    assert a.quota.held("remote", X) == 3 and b.quota.held("remote", X) == 3  # a speaks again: it claims a slot
    for s in (a, b):
        s.store.close()
    for s in (a, b):
        s.store.close(wait=True)
    server.kill()


def test_a_server_whose_store_fails_keeps_the_last_counts(server):
    a, b = Server(server.url), Server(server.url)
    for _ in range(3):
        a.store_block(X)
    assert b.quota.held("remote", X) == 3
    server.kill()
    assert b.quota.held("remote", X) == 3 and b.shares.errors == 1  # the last counts, one warning
    if server.url.startswith("mooncake://"):  # a master back on the port: the members leave at once, not after retries
        from tests.mooncake_fixture import start_master

        server.process = start_master(port=server.port).process
    for s in (a, b):
        s.store.close()


def test_engines_sharing_a_redis_tier_count_each_others_tenant_blocks(tmp_path_factory):
    from sage_infer import LLM, SamplingParams
    from sage_infer.config.serve import KVPoolConfig, ModelConfig, QuotaConfig, SchedulerConfig, ServeConfig, TierConfig
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path_factory.mktemp("quota-fleet") / "model", "llama")
    server = start_redis()
    try:
        def make_llm() -> LLM:
            return LLM(config=ServeConfig(
                model=ModelConfig(path=str(model_dir), dtype="fp32"),
                kv_pool=KVPoolConfig(block_size=16, num_blocks=8), scheduler=SchedulerConfig(max_num_seqs=1),
                tiers=TierConfig(remote_url=server.url),
                quota=QuotaConfig(tenants=[{"name": "noisy", "cache_salt": "n-salt", "max_share": 0.5}])),
                device="cpu")

        writer, reader = make_llm(), make_llm()
        writer_quota, reader_quota = writer.engine.kv.block_manager.quota, reader.engine.kv.block_manager.quota
        for quota in (writer_quota, reader_quota):
            quota.fleet["remote"].refresh_s = 0.0  # publish and read at once (the default: at most every 0.5 s)
        for seed in range(3):  # 3 prompts of 5 blocks through 8 device blocks: some go down to Redis
            writer.generate([[5 + (seed * 37 + 11 * j) % 500 for j in range(81)]],
                            SamplingParams(max_tokens=1, temperature=0), cache_salt="n-salt")
        [noisy] = [key for key, share in writer_quota.shares.items() if share.name == "noisy"]
        mine = writer_quota.local_blocks("remote").get(noisy, 0)
        assert mine > 0
        assert reader_quota.local_blocks("remote").get(noisy, 0) == 0
        assert reader_quota.held("remote", noisy) == mine  # the writer's blocks count against the tenant here too
    finally:
        server.kill()


def test_an_engine_on_a_mooncake_tier_shares_its_tenant_quotas_with_the_fleet(tmp_path):
    from sage_infer import LLM
    from sage_infer.config.serve import KVPoolConfig, ModelConfig, QuotaConfig, ServeConfig, TierConfig
    from sage_infer.kv_runtime.tiers.mooncake_shares import MooncakeTenantShares
    from tests.mooncake_fixture import start_master
    from tests.tiny_models import make_tiny_model

    server = start_master()
    try:
        llm = LLM(config=ServeConfig(
            model=ModelConfig(path=str(make_tiny_model(tmp_path / "model", "llama")), dtype="fp32"),
            kv_pool=KVPoolConfig(block_size=16, num_blocks=8), tiers=TierConfig(remote_url=server.url),
            quota=QuotaConfig(tenants=[{"name": "noisy", "cache_salt": "n-salt", "max_share": 0.5}])), device="cpu")
        assert isinstance(llm.engine.kv.block_manager.quota.fleet["remote"], MooncakeTenantShares)
        llm.close()
    finally:
        server.kill()
