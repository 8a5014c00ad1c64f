"""The Mooncake Store remote tier against a real `mooncake_master` on loopback: the tier
contract (bit-exact, verified prefixes, checksums, bounded capacity), sharing between
members, and failing fast when the master dies. Skips, naming what is missing, without the
`mooncake-transfer-engine-non-cuda` package or libibverbs1.
"""

from __future__ import annotations

import sys
import time

import crc32c
import numpy as np
import pytest
import torch

from sage_infer.config.serve import TierConfig
from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.errors import NotAvailableError
from sage_infer.kv_runtime.tiers import KVTier, TierConfigError, TierError
from sage_infer.kv_runtime.tiers.mooncake import VALUE_HEADER
from sage_infer.kv_runtime.tiers.mooncake_url import parse_mooncake_url
from tests.mooncake_fixture import start_master
from tests.redis_fixture import free_port
from tests.test_kv_tiers import BPB, SCHEMA, chain

BIG = KVCacheSchema(num_layers=2, num_kv_heads=8, head_dim=64, block_size=16)  # 64 KiB blocks


@pytest.fixture(scope="module")
def master():
    master = start_master()
    yield master
    master.kill()


@pytest.fixture
def make_tier(master):
    """make_tier(capacity_blocks, url=..., schema=...) -> a fresh MooncakeTier; closed at teardown."""
    from sage_infer.kv_runtime.tiers.mooncake import MooncakeTier

    made = []

    def make(capacity_blocks: int = 64, url: str | None = None, schema: KVCacheSchema = SCHEMA, **kwargs):
        tier = MooncakeTier(schema, url or master.url, capacity_blocks * schema.bytes_per_block, **kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
    for tier in made:
        tier.close(wait=True)


@pytest.fixture(scope="module")
def shared(master):
    """(tier, peer): two members of one store, shared by the contract tests (Mooncake's close takes
    ~2 s per member, so tests reuse them, with their own chains, and compare stats before/after).
    The peer stages 4 blocks at a time, so its reads of longer chains go in chunks."""
    from sage_infer.kv_runtime.tiers.mooncake import MooncakeTier

    tier, peer = MooncakeTier(SCHEMA, master.url, 256 * BPB), MooncakeTier(SCHEMA, master.url, 4 * BPB)
    yield tier, peer
    tier.close()
    peer.close(wait=True)  # before the master goes
    tier.close(wait=True)


def delta(tier, before) -> tuple[int, ...]:
    after = tier.stats()
    return tuple(getattr(after, f) - getattr(before, f) for f in ("puts", "gets", "hits", "misses",
                                                                   "checksum_failures", "blocks"))


def salted(request, n: int, suffix: str = ""):
    """A chain no other test in the shared store uses."""
    return chain(n, salt=request.node.name + suffix)


def value(block: torch.Tensor) -> bytes:
    """The stored form of a block: header, then payload."""
    from sage_infer.kv_runtime.tiers.mooncake import VALUE_HEADER, VALUE_MAGIC

    payload = block.numpy().tobytes()
    return VALUE_HEADER.pack(VALUE_MAGIC, crc32c.crc32c(payload), len(payload)) + payload


def raw_put(tier, key: bytes, data: bytes) -> None:
    """Replace a stored value behind the tier's back (on its worker, through its staging buffer)."""

    def put(call) -> list[int]:
        tier.store.batch_remove([tier.store_key(key)], True)
        tier._staging[0, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        return tier.store.batch_put_from([tier.store_key(key)], [tier._staging.ctypes.data], [len(data)])

    assert tier._call("corrupt", put) == [0]


def test_put_then_get_is_bit_exact(shared, request):
    tier, _ = shared
    assert isinstance(tier, KVTier)
    before = tier.stats()
    keys, blocks = salted(request, 5)
    tier.put(keys, blocks)
    assert torch.equal(torch.stack(tier.get(keys)), blocks)
    assert torch.equal(tier.get_prefix(keys), blocks)
    assert delta(tier, before) == (5, 10, 10, 0, 0, 5)
    assert tier.stats().bytes == tier.stats().blocks * BPB


def test_unknown_keys_are_misses_and_get_prefix_stops_at_the_first(shared, request):
    tier, _ = shared
    before = tier.stats()
    keys, blocks = salted(request, 6)
    tier.put(keys, blocks)
    tier.delete([keys[3]])
    assert [g is not None for g in tier.get(keys)] == [True, True, True, False, True, True]
    out = torch.zeros((8, BPB), dtype=torch.uint8)
    got = tier.get_prefix(keys, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, blocks[:3])
    assert delta(tier, before)[1:4] == (12, 8, 4)


def test_contains_and_delete(shared, request):
    tier, _ = shared
    before = tier.stats()
    keys, blocks = salted(request, 4)
    tier.put(keys, blocks)
    tier.delete([keys[1], keys[3], bytes(32)])  # an absent key is ignored
    assert tier.contains(keys) == [True, False, True, False]
    assert delta(tier, before)[-1] == 2


def test_a_corrupt_value_is_a_counted_miss_and_is_deleted(shared, request):
    tier, _ = shared
    before = tier.stats()
    keys, blocks = salted(request, 3)
    tier.put(keys, blocks)
    flipped = blocks[1].clone()
    flipped[7] ^= 1
    raw_put(tier, keys[1], value(blocks[1])[:VALUE_HEADER.size] + flipped.numpy().tobytes())
    raw_put(tier, keys[2], value(blocks[2])[:100])  # truncated
    assert torch.equal(tier.get_prefix(keys), blocks[:1])
    assert delta(tier, before)[4] == 1  # the prefix stopped at the first bad block
    assert [g is not None for g in tier.get(keys)] == [True, False, False]
    assert delta(tier, before)[4] == 2
    assert tier.contains(keys) == [True, False, False]  # bad blocks are deleted


def test_two_members_share_blocks_in_chunks_bigger_than_the_staging_buffer(shared, request):
    writer, reader = shared  # the reader stages 4 blocks at a time
    keys, blocks = salted(request, 23)
    writer.put(keys, blocks)
    assert torch.equal(reader.get_prefix(keys), blocks)  # read out of the writer's segment
    writer.delete([keys[17]])
    assert torch.equal(reader.get_prefix(keys), blocks[:17])


def test_the_tier_evicts_its_oldest_blocks_past_its_capacity(make_tier, request):
    tier = make_tier(8)
    first, first_blocks = salted(request, 4, "a")
    tier.put(first, first_blocks)
    tier.put(*salted(request, 4, "b"))
    tier.put(*salted(request, 1, "c"))
    assert tier.contains(first) == [True, True, True, False]  # a chain loses its tail first
    tier.put(*salted(request, 3, "d"))
    stats = tier.stats()
    assert (stats.blocks, stats.evictions) == (8, 4)
    assert tier.contains(first) == [False] * 4  # the oldest batch went first
    big, big_blocks = salted(request, 12, "e")  # bigger than the whole tier: its head is kept
    tier.put(big, big_blocks)
    assert tier.stats().dropped == 4
    assert torch.equal(tier.get_prefix(big), big_blocks[:8])


def test_a_full_store_drops_puts_and_never_raises():
    """Mooncake answers NO_AVAILABLE_HANDLE when the mounted segments are full (its own eviction
    runs only above the master's high watermark, which a full segment may never reach)."""
    from sage_infer.kv_runtime.tiers.mooncake import MooncakeTier

    master = start_master()  # a store of one 16 MiB segment: ~230 blocks of 64 KiB
    tier = MooncakeTier(BIG, master.url + "?segment=16MiB", 400 * BIG.bytes_per_block)
    try:
        fill(tier)
    finally:
        tier.close(wait=True)
        master.kill()


def fill(tier) -> None:
    keys = [bytes([i % 256, i // 256]) + bytes(30) for i in range(400)]
    blocks = torch.randint(0, 256, (400, BIG.bytes_per_block), dtype=torch.uint8)
    tier.put(keys, blocks)
    stats = tier.stats()
    assert stats.dropped > 0 and stats.errors == 0
    assert stats.blocks == 400 - stats.dropped
    kept = tier.get_prefix(keys)
    assert len(kept) > 100 and torch.equal(kept, blocks[: len(kept)])


def test_different_schemas_never_see_each_others_blocks(shared, make_tier, request):
    other = KVCacheSchema(num_layers=4, num_kv_heads=1, head_dim=8, block_size=4)  # same block size
    a, b = shared[0], make_tier(schema=other)
    keys, blocks = salted(request, 2)
    a.put(keys, blocks)
    assert b.contains(keys) == [False, False]
    assert a.store_key(keys[0]) != b.store_key(keys[0])


def test_a_killed_master_makes_calls_raise_tier_error_quickly():
    from sage_infer.kv_runtime.tiers.mooncake import MooncakeTier

    master = start_master()
    keys, blocks = chain(2, salt="killed")
    tier = MooncakeTier(SCHEMA, master.url + "?timeout=0.5", 64 * BPB)
    try:
        tier.put(keys, blocks)
        master.kill()
        for call in (lambda: tier.get_prefix(keys), lambda: tier.put(keys, blocks),
                     lambda: tier.contains(keys), lambda: tier.get(keys)):
            start = time.monotonic()
            with pytest.raises(TierError, match="mooncake://127.0.0.1"):
                call()
            assert time.monotonic() - start < 2.0  # the 0.5 s timeout, never Mooncake's own ~4 s retry
        stats = tier.stats()  # never raises
        assert stats.errors >= 4 and stats.blocks == 2
    finally:
        master = start_master(port=master.port)  # back, so that leaving the store takes 2 s, not 12
        tier.close(wait=True)
        master.kill()


def test_no_master_listening_raises_tier_error(master):
    from sage_infer.kv_runtime.tiers.mooncake import MooncakeTier

    start_master().kill()  # skips without mooncake
    start = time.monotonic()
    with pytest.raises(TierError, match="no mooncake_master at 127.0.0.1"):
        MooncakeTier(SCHEMA, f"mooncake://127.0.0.1:{free_port()}", 64 * BPB, setup_timeout_s=3)
    with pytest.raises(TierError, match="no metadata server at 127.0.0.1"):
        MooncakeTier(SCHEMA, f"{master.url}?metadata=http://127.0.0.1:{free_port()}/metadata", 64 * BPB)
    assert time.monotonic() - start < 5


def test_a_missing_mooncake_package_says_how_to_install_it(monkeypatch):
    from sage_infer.kv_runtime.tiers.mooncake import MooncakeTier

    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(NotAvailableError, match=r"pip install 'sage-infer\[mooncake\]'"):
        MooncakeTier(SCHEMA, "mooncake://127.0.0.1:1", 64 * BPB)


@pytest.mark.parametrize(
    ("url", "fields"),
    [
        ("mooncake://10.0.0.5", {"master": "10.0.0.5:50051", "metadata": "P2PHANDSHAKE", "protocol": "tcp"}),
        ("mooncake://m:7000?metadata=http%3A//m%3A8080/metadata&protocol=rdma&device=mlx5_0",
         {"master": "m:7000", "metadata": "http://m:8080/metadata", "protocol": "rdma", "device": "mlx5_0"}),
        ("mooncake://m:1?metadata=http://m:8080/metadata", {"metadata": "http://m:8080/metadata"}),
        ("mooncake://m:1?segment=1GiB&local=10.0.0.9&timeout=2.5",
         {"segment_bytes": 1 << 30, "local": "10.0.0.9", "timeout_s": 2.5}),
        ("mooncake://m:1?segment=0", {"segment_bytes": 0}),
    ],
)
def test_mooncake_urls_are_parsed(url, fields):
    address = parse_mooncake_url(url)
    assert {k: getattr(address, k) for k in fields} == fields


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://x", "scheme"),
        ("mooncake://:50051", "no master host"),
        ("mooncake://m:99999", "port"),
        ("mooncake://m:1/db", "no path"),
        ("mooncake://m:1?protocol=udp", "protocol"),
        ("mooncake://m:1?metadata=etcd", "metadata"),
        ("mooncake://m:1?segment=1MiB", "at least 16MiB"),
        ("mooncake://m:1?segment=lots", "segment must be a size"),
        ("mooncake://m:1?timeout=0", "timeout"),
        ("mooncake://m:1?replicas=2", "unknown option 'replicas'"),
    ],
)
def test_bad_mooncake_urls_name_the_problem(url, problem):
    with pytest.raises(TierConfigError, match="mooncake URL") as err:
        parse_mooncake_url(url)
    assert problem in str(err.value)


def test_the_config_and_the_kv_tiers_flag_accept_a_mooncake_url(sage):
    url = "mooncake://127.0.0.1:50051?protocol=tcp&segment=64MiB"
    assert TierConfig(remote_url=url).remote_url == url
    result = sage("config", "show", "--preset", "cpu", "--json", "--kv-tiers", f"remote={url},remote-bytes=32MiB")
    assert result.code == 0, result.err
    assert url in result.out


def test_two_engines_share_prefixes_through_mooncake(master, tmp_path):
    """`build_hierarchy` makes a MooncakeTier of a mooncake:// URL; A's blocks, evicted by the
    writer engine's pool, are loaded by a second engine out of the writer's segment: the same
    tokens as a cold run, with A's 5 full blocks cached."""
    from sage_infer.kv_runtime.tiers.mooncake import MooncakeTier
    from tests.test_kv_tiers_engine import BLOCK, A, B, C, make_llm, run
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", "llama")
    cold = run(make_llm(model_dir), A)[0]
    writer = make_llm(model_dir, remote_url=master.url, remote_bytes=64 << 20)
    reader = None
    try:
        [store] = writer.engine.kv.source("tiers").hierarchy.stores
        assert isinstance(store, MooncakeTier) and store.name == "mooncake" and store.shared
        for tokens in (A, B, C):
            run(writer, tokens)
        reader = make_llm(model_dir, remote_url=master.url, remote_bytes=64 << 20)
        assert run(reader, A) == (cold, 5 * BLOCK)
    finally:
        for llm in (writer, reader):
            if llm is not None:
                [store] = llm.engine.kv.source("tiers").hierarchy.stores
                store.close(wait=True)
