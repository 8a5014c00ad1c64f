"""SageKVConnector's logic without vLLM: keys, the step planner, block bytes and the store.

The vLLM side (real engine, real stores) is tests/test_vllm_connector.py.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest
import torch

from sage_infer.errors import ConfigError
from sage_infer.integrations.vllm import kv_transfer_config
from sage_infer.integrations.vllm.blocks import PagedBlocks, block_schema
from sage_infer.integrations.vllm.config import SageConnectorConfig
from sage_infer.integrations.vllm.keys import KeySpace, extend_chain, vllm_layout
from sage_infer.integrations.vllm.plan import ConnectorPlanner, ScheduledRequest
from sage_infer.integrations.vllm.store import ConnectorStore, open_store
from sage_infer.kv_runtime.tiers.disk import DiskTier
from sage_infer.kv_runtime.tiers.redis import RedisTier
from sage_infer.prefix_reuse.hashing import hash_token_blocks, make_extra_key
from tests.redis_fixture import free_port

BS = 4  # block size of the planner tests
SPACE = KeySpace("org/model", "main|none|float32", "fp32", vllm_layout(BS))


def lookup_of(stored: set[bytes]):
    def lookup(keys: list[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in stored:
            n += 1
        return n

    return lookup


def keys_of(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return hash_token_blocks(tokens, BS, SPACE.extra_key(salt))


# -- keys -------------------------------------------------------------------------------------


def test_extended_chain_equals_sages_block_hashes():
    tokens = list(range(23))
    extra = SPACE.extra_key(None)
    keys = extend_chain([], tokens[:9], 2, BS, extra)
    extend_chain(keys, tokens, 5, BS, extra)  # continues the chain from block 2
    assert keys == hash_token_blocks(tokens, BS, extra)


def test_the_layout_names_vllm_block_size_and_parallel_layout():
    assert vllm_layout(128) == "vllm-cpu-NHD2/bs128/tp1pp1"
    assert vllm_layout(16, 2, 1) != vllm_layout(16)


def test_vllm_keys_never_equal_sage_native_keys_for_the_same_tokens():
    native = make_extra_key("org/model", "main|none|float32", "fp32", "NHD", None)
    assert native != SPACE.extra_key(None)
    assert hash_token_blocks(list(range(8)), BS, native)[0] != keys_of(list(range(8)))[0]


def test_each_cache_salt_is_its_own_key_space():
    salts = [None, "", "tenant-a", "tenant-b"]
    assert len({SPACE.extra_key(s) for s in salts}) == 4
    assert SPACE.extra_key("tenant-a") == SPACE.extra_key("tenant-a")


# -- the planner -----------------------------------------------------------------------------


def test_match_offers_whole_stored_blocks_and_never_the_last_prompt_token():
    planner = ConnectorPlanner(BS, SPACE)
    prompt = list(range(12))  # 3 full blocks; the last one holds the last token
    stored = set(keys_of(prompt))
    assert planner.match("r", prompt, None, 0, lookup_of(stored)) == 8
    assert planner.match("r", prompt[:9], None, 0, lookup_of(stored)) == 8
    assert planner.match("r", prompt[:8], None, 0, lookup_of(stored)) == 4


def test_match_counts_only_what_is_past_vllms_own_prefix_hit():
    planner = ConnectorPlanner(BS, SPACE)
    prompt = list(range(13))
    stored = set(keys_of(prompt)[:2])
    assert planner.match("r", prompt, None, 4, lookup_of(stored)) == 4
    assert planner.match("r", prompt, None, 8, lookup_of(stored)) == 0
    assert planner.match("r", prompt, None, 12, lookup_of(stored)) == 0


def test_match_under_another_salt_finds_nothing():
    planner = ConnectorPlanner(BS, SPACE)
    prompt = list(range(13))
    stored = set(keys_of(prompt, "tenant-a"))
    assert planner.match("a", prompt, "tenant-a", 0, lookup_of(stored)) == 12
    assert planner.match("b", prompt, "tenant-b", 0, lookup_of(stored)) == 0
    assert planner.match("n", prompt, None, 0, lookup_of(stored)) == 0


def test_a_match_stops_at_the_first_missing_block():
    planner = ConnectorPlanner(BS, SPACE)
    prompt = list(range(17))
    keys = keys_of(prompt)
    assert planner.match("r", prompt, None, 0, lookup_of({keys[0], keys[2], keys[3]})) == 4


def test_the_load_goes_into_the_blocks_vllm_allocated_after_its_own_hit():
    planner = ConnectorPlanner(BS, SPACE)
    prompt = list(range(13))
    keys = keys_of(prompt)
    planner.match("r", prompt, None, 4, lookup_of(set(keys)))
    planner.allocated("r", [70, 71, 72, 73], 8)
    plan = planner.plan_step([ScheduledRequest("r", prompt, 13, [70, 71, 72, 73])])
    assert [(io.block_ids, io.keys) for io in plan.loads] == [([71, 72], keys[1:3])]
    assert plan.saves == []  # blocks 0..2 are stored already; block 3 is not full
    assert planner.plan_step([ScheduledRequest("r", prompt, 13, [70, 71, 72, 73])]).loads == []


def test_a_step_saves_the_blocks_it_fills_once():
    planner = ConnectorPlanner(BS, SPACE)
    tokens = list(range(10))
    planner.match("r", tokens, None, 0, lookup_of(set()))
    plan = planner.plan_step([ScheduledRequest("r", tokens, 10, [5, 6, 7])])
    assert [(io.block_ids, io.keys) for io in plan.saves] == [([5, 6], keys_of(tokens)[:2])]
    tokens += [10, 11]  # two decode steps fill block 2
    assert planner.plan_step([ScheduledRequest("r", tokens[:11], 11, [5, 6, 7])]).saves == []
    plan = planner.plan_step([ScheduledRequest("r", tokens, 12, [5, 6, 7])])
    assert [(io.block_ids, io.keys) for io in plan.saves] == [([7], keys_of(tokens)[2:3])]
    assert planner.plan_step([ScheduledRequest("r", tokens, 12, [5, 6, 7])]).saves == []


def test_a_block_whose_last_token_is_not_known_yet_is_saved_a_step_later():
    planner = ConnectorPlanner(BS, SPACE)
    tokens = list(range(7))
    planner.match("r", tokens, None, 0, lookup_of(set()))
    planner.plan_step([ScheduledRequest("r", tokens, 7, [1, 2])])
    # async scheduling: slot 7 is computed this step, its token arrives with the step's output
    assert planner.plan_step([ScheduledRequest("r", tokens, 8, [1, 2])]).saves == []
    tokens.append(7)
    plan = planner.plan_step([ScheduledRequest("r", tokens + [8], 9, [1, 2, 3])])
    assert [io.block_ids for io in plan.saves] == [[2]]


def test_a_finished_request_keeps_its_blocks_until_its_last_save_is_planned():
    planner = ConnectorPlanner(BS, SPACE)
    tokens = list(range(7))
    planner.match("r", tokens, None, 0, lookup_of(set()))
    planner.plan_step([ScheduledRequest("r", tokens, 7, [1, 2])])
    assert planner.finished("r", tokens + [7, 8], 8, [1, 2]) is True
    plan = planner.plan_step([])
    assert [io.block_ids for io in plan.saves] == [[2]] and plan.finished_saves == ["r"]
    assert planner.plan_step([]).finished_saves == [] and planner.num_requests == 0


def test_a_finished_request_with_everything_saved_frees_at_once():
    planner = ConnectorPlanner(BS, SPACE)
    tokens = list(range(9))
    planner.match("r", tokens, None, 0, lookup_of(set()))
    planner.plan_step([ScheduledRequest("r", tokens, 9, [1, 2, 3])])
    assert planner.finished("r", tokens + [9], 9, [1, 2, 3]) is False
    assert planner.finished("never-matched", tokens, 9, [1, 2, 3]) is False


def test_without_save_decode_only_prompt_blocks_are_saved():
    planner = ConnectorPlanner(BS, SPACE, save_decode=False)
    tokens = list(range(6))
    planner.match("r", tokens, None, 0, lookup_of(set()))
    plan = planner.plan_step([ScheduledRequest("r", tokens + [6, 7, 8, 9], 10, [1, 2, 3])])
    assert [io.block_ids for io in plan.saves] == [[1]]


# -- block bytes -------------------------------------------------------------------------------


def vllm_caches(num_layers=3, num_blocks=6, heads=2, bs=4, head=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, heads, bs, 2 * head, generator=gen).to(dtype) for _ in range(num_layers)]


def test_a_block_row_is_each_layers_block_tile_in_layer_order():
    caches = vllm_caches()
    rows = PagedBlocks(caches, 4).gather([4, 1])
    assert rows.shape == (2, block_schema(3, 2, 8, 4, torch.float32).bytes_per_block)
    expected = torch.cat([c[4].reshape(-1) for c in caches]).view(torch.uint8)
    assert torch.equal(rows[0], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_gathered_from_one_cache_scatter_into_another_bit_exact(dtype):
    src, dst = vllm_caches(dtype=dtype), vllm_caches(dtype=dtype, seed=1)
    before = [d.clone() for d in dst]
    PagedBlocks(dst, 4).scatter([5, 0], PagedBlocks(src, 4).gather([2, 3]))
    for s, d, b in zip(src, dst, before):
        assert torch.equal(d[5], s[2]) and torch.equal(d[0], s[3])
        assert torch.equal(d[1:5], b[1:5])  # nothing else touched


def test_a_cache_that_is_not_vllms_cpu_layout_is_refused():
    from sage_infer.errors import NotAvailableError

    with pytest.raises(NotAvailableError, match="CPU layout"):
        PagedBlocks([torch.zeros(2, 6, 4, 2, 8)], 4)  # a GPU-style [2, num_blocks, ...] cache
    with pytest.raises(ValueError, match="out of range"):
        PagedBlocks(vllm_caches(), 4).gather([6])


# -- the store ---------------------------------------------------------------------------------

SCHEMA = block_schema(3, 2, 8, 4, torch.float32)


def rows_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, SCHEMA.bytes_per_block), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def test_a_chain_split_across_two_tiers_loads_whole(tmp_path):
    keys = keys_of(list(range(12)))
    rows = rows_of(3)
    with DiskTier(SCHEMA, tmp_path / "a", 1 << 20) as a, DiskTier(SCHEMA, tmp_path / "b", 1 << 20) as b:
        a.put([keys[0], keys[2]], rows[[0, 2]])
        b.put([keys[1]], rows[1:2])
        store = ConnectorStore([a, b])
        assert store.lookup(keys) == 3
        out = torch.empty_like(rows)
        assert store.load(keys, out) == 3 and torch.equal(out, rows)


def test_a_dead_remote_tier_is_a_miss_and_a_dropped_save_never_an_error(tmp_path):
    dead = RedisTier(SCHEMA, f"redis://127.0.0.1:{free_port()}/0", 1 << 20, socket_timeout=0.2,
                     connect_timeout=0.2)
    keys = keys_of(list(range(8)))
    with DiskTier(SCHEMA, tmp_path, 1 << 20) as disk:
        store = ConnectorStore([disk, dead])
        store.save(keys, rows_of(2))
        disk.flush()
        assert store.lookup(keys) == 2  # the disk still answers
        assert ConnectorStore([dead]).lookup(keys) == 0
        out = torch.empty(2, SCHEMA.bytes_per_block, dtype=torch.uint8)
        assert ConnectorStore([dead]).load(keys, out) == 0
        assert store.stats.errors >= 1


def test_one_process_shares_one_store_per_configuration(tmp_path):
    config = SageConnectorConfig(disk_path=str(tmp_path), disk_bytes=1 << 20)
    first, second = open_store(config, SCHEMA), open_store(config, SCHEMA)
    assert first is second
    first.release()
    assert not second.closed
    second.release()
    assert second.closed


def test_a_disk_directory_in_use_by_another_instance_is_refused(tmp_path):
    fd = os.open(tmp_path / "sage-vllm.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what another vLLM instance's connector holds
    try:
        with pytest.raises(ConfigError, match="in use by another vLLM instance"):
            open_store(SageConnectorConfig(disk_path=str(tmp_path), disk_bytes=1 << 20), SCHEMA)
    finally:
        os.close(fd)


# -- configuration -----------------------------------------------------------------------------


def test_the_connector_needs_a_store():
    with pytest.raises(ConfigError, match="set disk_path, remote_url or both"):
        SageConnectorConfig.parse({})


def test_an_unknown_setting_is_one_line_naming_it():
    with pytest.raises(ConfigError, match="disk_pth"):
        SageConnectorConfig.parse({"disk_pth": "/tmp/x"})


def test_kv_transfer_config_loads_the_connector_by_module_path_and_recomputes_failed_loads():
    config = kv_transfer_config(disk_path="/tmp/kv", disk_bytes=1 << 30)
    assert config["kv_connector"] == "SageKVConnector"
    assert config["kv_connector_module_path"] == "sage_infer.integrations.vllm.connector"
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"] == {"disk_path": "/tmp/kv", "disk_bytes": 1 << 30}


def test_importing_sage_and_the_integration_package_does_not_import_vllm():
    code = ("import sys, sage_infer, sage_infer.integrations.vllm, sage_infer.integrations.vllm.store; "
            "sys.exit(1 if 'vllm' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_blocks_one_instance_saves_another_loads_into_its_own_block_ids_bit_exact(tmp_path):
    """The whole data path without vLLM: plan -> gather -> disk store -> (new process) match -> load -> scatter."""
    tokens = list(range(13))  # 3 full blocks of 4 and a last token
    writer_cache = vllm_caches(num_blocks=8, seed=3)
    writer = ConnectorPlanner(BS, SPACE)
    config = SageConnectorConfig(disk_path=str(tmp_path), disk_bytes=1 << 20)
    store = open_store(config, SCHEMA)
    assert writer.match("w", tokens, None, 0, store.lookup) == 0
    plan = writer.plan_step([ScheduledRequest("w", tokens, 13, [6, 2, 7, 0])])
    for io in plan.saves:
        store.save(io.keys, PagedBlocks(writer_cache, BS).gather(io.block_ids))
    store.release()  # flushed and closed: the next open scans the directory, as a restarted instance does

    reader_cache = vllm_caches(num_blocks=8, seed=4)
    reader = ConnectorPlanner(BS, SPACE)
    store = open_store(config, SCHEMA)
    assert reader.match("r", tokens, None, 0, store.lookup) == 12
    reader.allocated("r", [1, 3, 5, 4], 12)
    (load,) = reader.plan_step([ScheduledRequest("r", tokens, 13, [1, 3, 5, 4])]).loads
    rows = torch.empty(3, SCHEMA.bytes_per_block, dtype=torch.uint8)
    assert store.load(load.keys, rows) == 3
    PagedBlocks(reader_cache, BS).scatter(load.block_ids, rows)
    store.release()
    for w, r in zip(writer_cache, reader_cache):
        assert torch.equal(r[[1, 3, 5]], w[[6, 2, 7]])


def test_the_schedulers_disk_index_sees_what_another_process_wrote_and_what_it_plans(tmp_path):
    from sage_infer.integrations.vllm.disk_index import DiskKeyIndex

    keys = keys_of(list(range(16)))
    with DiskTier(SCHEMA, tmp_path, 1 << 20) as disk:  # the worker's tier, still open
        disk.put(keys[:2], rows_of(2))
        disk.flush()
        index = DiskKeyIndex(tmp_path, SCHEMA, 3 * SCHEMA.bytes_per_block)
        assert index.contains(keys) == [True, True, False, False]
        index.add(keys[2:4])  # planned saves; the capacity holds 3 blocks: the oldest goes
        assert index.contains(keys) == [False, True, True, True]
    assert DiskKeyIndex(tmp_path, block_schema(2, 2, 8, 4, torch.float32), 1 << 20).contains(keys[:1]) == [False]


# -- sage's policies over the disk store ----------------------------------------------------------


def test_the_disk_index_evicts_by_its_policy_and_names_the_victims(tmp_path):
    from sage_infer.integrations.vllm.disk_index import DiskKeyIndex

    a, b, c = keys_of(list(range(8))), keys_of(list(range(100, 108))), keys_of(list(range(200, 208)))
    lru = DiskKeyIndex(tmp_path, SCHEMA, 4 * SCHEMA.bytes_per_block, "lru")
    assert lru.add(a) == [] and lru.add(b) == []
    lru.hit(a)  # a was loaded again: b is now the least recently used
    assert lru.add(c) == b
    assert lru.contains(a + b + c) == [True, True, False, False, True, True]
    assert lru.evicted == 2


def test_a_tenant_at_its_max_share_evicts_its_own_blocks_first(tmp_path):
    from sage_infer.config.serve import QuotaConfig
    from sage_infer.integrations.vllm.disk_index import DiskKeyIndex
    from sage_infer.kv_policy.quota import build_quota

    quota = build_quota(QuotaConfig.model_validate({"tenants": [{"name": "a", "cache_salt": "salt-a",
                                                                 "max_share": 0.5}]}), SPACE.extra_key)
    index = DiskKeyIndex(tmp_path, SCHEMA, 4 * SCHEMA.bytes_per_block, "lru", quota)
    other = keys_of(list(range(8)))
    assert index.add(other, tenant=SPACE.extra_key(None)) == []
    tokens = list(range(300, 312))
    mine = keys_of(tokens, "salt-a")
    evicted = index.add(mine, tenant=SPACE.extra_key("salt-a"))  # 3 blocks, its cap is 2 of 4
    assert evicted == mine[:1]  # its own oldest, not the other tenant's
    assert index.contains(other) == [True, True]
    assert quota.held("disk", SPACE.extra_key("salt-a")) == 2


def test_a_worker_drop_deletes_from_the_disk_in_order_with_the_saves(tmp_path):
    from sage_infer.integrations.vllm.store import BlockSaver

    keys = keys_of(list(range(12)))
    store = open_store(SageConnectorConfig(disk_path=str(tmp_path), disk_bytes=1 << 20), SCHEMA)
    saver = BlockSaver(store, 1 << 20)
    try:
        saver.submit(keys[:2], rows_of(2))
        saver.drop(keys[:1])
        saver.submit(keys[2:3], rows_of(1, seed=1))
        saver.flush()
        store.flush()
        assert store.tiers[0].contains(keys) == [False, True, True]
        assert store.stats.dropped == 1
    finally:
        saver.close()
        store.release()


def test_admission_keeps_the_blocks_from_the_first_worth_saving_as_one_run():
    from sage_infer.integrations.vllm.plan import BlockIO, admit

    keys = keys_of(list(range(16)))
    io = BlockIO("r", [4, 5, 6, 7], keys, first=0, tenant=b"t")
    kept = admit(io, lambda depth: depth >= 2)
    assert (kept.block_ids, kept.keys, kept.first, kept.parent, kept.tenant) == ([6, 7], keys[2:], 2, keys[1], b"t")
    assert admit(io, lambda depth: True) is io
    assert admit(io, lambda depth: False).keys == []


def test_the_cost_model_shape_of_a_vllm_model_counts_its_weights():
    from types import SimpleNamespace

    from sage_infer.integrations.vllm.plan import model_shape

    hf = SimpleNamespace(hidden_size=896, num_attention_heads=14, intermediate_size=4864, vocab_size=151936)
    shape = model_shape(hf, block_schema(24, 2, 64, 128, torch.bfloat16))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes) == (24, 2, 64, 2)
    assert 0.45e9 < shape.num_params < 0.55e9  # Qwen2.5-0.5B: 494M with its embedding


def test_policies_need_the_disk_store():
    with pytest.raises(ConfigError, match="set disk_path"):
        SageConnectorConfig.parse({"remote_url": "redis://127.0.0.1:6379/0", "hardware_preset": "cpu"})
    with pytest.raises(ConfigError, match="eviction"):
        SageConnectorConfig.parse({"disk_path": "/tmp/x", "eviction": "opt"})  # offline only: it needs the future
