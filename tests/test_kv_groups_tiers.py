"""Lower KV tiers for a model with KV groups (sliding-window layers): every group's evicted blocks are demoted, and a
prefix hit loads back only what it needs (every full-attention block of the prefix, a sliding group's window), so it
moves far fewer bytes than a full-attention layout; a Gemma-3-shaped model (5 sliding layers to 1 full) whose prompt,
longer than its window, was evicted to the host tier (or written to disk by an engine before, or to a Redis another
engine shares) gives transformers' greedy tokens when it comes back."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
from sage_infer.core.sampling_params import SamplingParams as Params
from sage_infer.core.sequence import Sequence
from sage_infer.kv_policy import make_policy
from sage_infer.kv_policy.load_or_compute import LoadOrCompute, Rate
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.group_kv_manager import GroupKVCacheManager
from sage_infer.kv_runtime.group_tiers import GroupTierSource
from sage_infer.kv_runtime.hierarchy import HierarchyManager
from sage_infer.kv_runtime.kv_groups import kv_groups
from sage_infer.kv_runtime.pool import KVPool
from sage_infer.kv_runtime.tiers import HostTier
from sage_infer.prefix_reuse.index import PrefixReuseIndex
from tests.redis_fixture import start_redis
from tests.test_engine_vs_transformers import random_prompts
from tests.test_kv_groups import greedy, llm, outputs
from tests.tiny_models import save_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 4
WINDOW = 8  # a sliding group's hit needs ceil(7 / 4) = 2 blocks


def tiered_manager(windows, num_blocks: int = 64):
    """A `GroupKVCacheManager` over a float pool of 1-layer blocks and a 1 MiB host tier."""
    groups = kv_groups(windows)
    pool = KVPool(KVCacheSchema(groups.layers_per_block, 1, 8, BS, KVDtype.FP32), num_blocks)
    host = HostTier(pool.schema, 1 << 20, pin=False)
    hierarchy = HierarchyManager.build(pool, [host], lambda capacity: make_policy("lru", capacity=capacity))
    manager = BlockManager(num_blocks, BS, PrefixReuseIndex(BS))
    return GroupKVCacheManager(manager, groups, sources=[GroupTierSource(hierarchy)]), pool, hierarchy


def compute(kv: GroupKVCacheManager, pool: KVPool, seq: Sequence) -> None:
    """What a prefill step does to the pool: every group's blocks of `seq` hold a tag of (group, position)."""
    for group, table in enumerate(kv.tables(seq)):
        for i, block in enumerate(table):
            if block != kv.null_block:
                pool.write_rows([block], torch.full((1, pool.block_nbytes), 1 + group * 16 + i, dtype=torch.uint8))
    seq.num_computed_tokens = seq.num_tokens
    kv.commit(seq)


def tag(pool: KVPool, block: int) -> int:
    row = pool.read_blocks([block]).view(torch.uint8).reshape(-1)
    assert bool((row == row[0]).all())
    return int(row[0])


def test_a_hybrid_hit_loads_the_full_groups_prefix_and_each_sliding_groups_window_only():
    kv, pool, hierarchy = tiered_manager([WINDOW] * 5 + [None])  # 6 groups of one layer: 1 full, 5 sliding
    prompt = list(range(100, 100 + 6 * BS + 2))
    first = Sequence(0, "a", 0, list(prompt), len(prompt), Params(), b"k")
    assert kv.admit(first, kv.match(first), len(prompt))
    compute(kv, pool, first)
    kv.free(first)
    demoted = kv.block_manager.reset_prefix_cache()  # every cached block of every group goes down to the host tier
    assert demoted == hierarchy.stats.demoted_blocks == 6 * 6  # (a sliding group's blocks out of the window too)
    again = Sequence(1, "b", 0, prompt + [1, 2], len(prompt) + 2, Params(), b"k")
    match = kv.match(again)
    assert (match.num_tokens, match.total_tokens) == (0, 6 * BS)
    assert len(match.lower_block_hashes) == 6 + 5 * 2
    assert kv.admit(again, match, again.num_tokens - match.total_tokens)
    assert again.num_computed_tokens == 6 * BS and kv.lower_hit_tokens == 6 * BS
    loaded = hierarchy.stats.loaded_blocks
    assert loaded == 6 + 5 * 2
    # a full-attention layout of the same 6 layers moves every layer's 6 blocks: 36 blocks of one layer
    assert loaded * pool.block_nbytes / (6 * 6 * pool.block_nbytes) == pytest.approx(16 / 36)
    for group, table in enumerate(kv.tables(again)):  # each block holds what its group computed at its position
        first_needed = 0 if group == 0 else 4
        assert table[:first_needed] == [kv.null_block] * first_needed
        assert [tag(pool, b) for b in table[first_needed:6]] == [1 + group * 16 + i for i in range(first_needed, 6)]
    kv.block_manager.check_invariants()
    kv.free(again)
    third = Sequence(2, "c", 0, prompt + [3], len(prompt) + 1, Params(), b"k")
    assert kv.match(third).num_tokens == 6 * BS  # the loaded blocks were registered: a device hit now


def demote(kv: GroupKVCacheManager, hierarchy: HierarchyManager, blocks: list[int]) -> None:
    """What an allocation's eviction does to these cached blocks (the policy would choose which)."""
    manager = kv.block_manager
    for block in blocks:
        hierarchy.on_evict([manager.index.evict_block(lambda b, block=block: b == block)])
        manager.num_tokens[block] = 0
        manager.free_block_ids.append(block)


def test_blocks_the_device_still_holds_are_taken_there_and_only_the_rest_is_loaded():
    kv, pool, hierarchy = tiered_manager([WINDOW, None])
    prompt = list(range(7, 7 + 6 * BS + 1))
    first = Sequence(0, "a", 0, list(prompt), len(prompt), Params(), b"k")
    assert kv.admit(first, kv.match(first), len(prompt))
    full, sliding = (list(table) for table in kv.tables(first))  # (before the window frees the early blocks)
    compute(kv, pool, first)
    kv.free(first)
    demote(kv, hierarchy, [full[5], full[4], sliding[5]])
    again = Sequence(1, "b", 0, prompt + [1], len(prompt) + 1, Params(), b"k")
    match = kv.match(again)
    assert (match.num_tokens, match.total_tokens) == (4 * BS, 6 * BS)  # the device alone: 4 blocks (window 2..3)
    assert kv.admit(again, match, again.num_tokens - match.total_tokens)
    assert hierarchy.stats.loaded_blocks == 3  # what the device lost, no more
    tables = kv.tables(again)
    assert tables[0][:4] == full[:4] and tables[1][:6] == [kv.null_block] * 4 + [sliding[4], tables[1][5]]
    assert [tag(pool, b) for b in tables[0][:6]] == [1 + i for i in range(6)]
    assert [tag(pool, b) for b in tables[1][4:6]] == [17 + 4, 17 + 5]
    kv.block_manager.check_invariants()  # (the device's own window, 2..3, taken in case the load fell short: back)
    assert kv.block_manager.ref_counts[sliding[2]] == kv.block_manager.ref_counts[sliding[3]] == 0


def test_a_short_load_falls_back_to_a_prefix_every_group_serves_and_never_reads_a_wrong_block():
    kv, pool, hierarchy = tiered_manager([WINDOW, None])
    prompt = list(range(50, 50 + 6 * BS + 1))
    first = Sequence(0, "a", 0, list(prompt), len(prompt), Params(), b"k")
    assert kv.admit(first, kv.match(first), len(prompt))
    compute(kv, pool, first)
    kv.free(first)
    kv.block_manager.reset_prefix_cache()
    again = Sequence(1, "b", 0, list(prompt), len(prompt), Params(), b"k")
    match = kv.match(again)
    host = hierarchy.stores[0]
    host.delete([match.lower_block_hashes[-1]])  # the sliding group's last window block is gone meanwhile
    assert kv.admit(again, match, again.num_tokens - match.total_tokens)
    assert again.num_computed_tokens == 0  # without it the sliding group serves no prefix: all is computed
    assert hierarchy.stats.failures["miss"] == 1
    assert all(b != kv.null_block for table in kv.tables(again) for b in table)
    kv.block_manager.check_invariants()


def test_a_hybrid_hit_measured_slower_to_load_than_to_compute_is_computed():
    kv, pool, hierarchy = tiered_manager([WINDOW, None])
    prompt = list(range(30, 30 + 6 * BS + 1))
    first = Sequence(0, "a", 0, list(prompt), len(prompt), Params(), b"k")
    assert kv.admit(first, kv.match(first), len(prompt))
    compute(kv, pool, first)
    kv.free(first)
    kv.block_manager.reset_prefix_cache()
    rates = hierarchy.rates = LoadOrCompute(BS, pool.block_nbytes)
    rates.prefill.observe(1e9, 1.0)  # a billion tokens a second
    rates.reads.setdefault(1, Rate()).observe(1.0, 1.0)  # the host tier: a byte a second
    again = Sequence(1, "b", 0, list(prompt), len(prompt), Params(), b"k")
    match = kv.match(again)
    assert match.total_tokens == 0 and match.plan is None
    assert kv.admit(again, match, again.num_tokens)
    assert hierarchy.stats.loaded_blocks == 0 and hierarchy.stats.failures["recompute"] == 6 + 2
    rates.reads[1] = Rate()
    rates.reads[1].observe(1e12, 1.0)  # now reading is faster
    kv.free(again)
    kv.block_manager.reset_prefix_cache()
    third = Sequence(2, "c", 0, list(prompt), len(prompt), Params(), b"k")
    assert kv.match(third).total_tokens == 6 * BS


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """A Gemma-3-shaped model: 5 sliding layers (window 16) to 1 full one, random weights and norms."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1,
        pad_token_id=2, sliding_window=16, query_pre_attn_scalar=24, sliding_window_pattern=6)
    hf = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.5)
    directory = tmp_path_factory.mktemp("gemma3-tiers") / "model"
    hf.save_pretrained(directory)
    save_tokenizer(directory, 512)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    prompts = random_prompts([5 * 16 + 3, 5 * 16 + 7, 5 * 16 + 1], seed=31)  # each past the window 5 times
    return directory, prompts, [greedy(hf, prompt, 6) for prompt in prompts]


def test_gemma3_prompts_evicted_to_the_host_tier_come_back_with_transformers_tokens(gemma3):
    directory, prompts, want = gemma3
    plain = llm(directory, num_blocks=40, scheduler={"max_num_seqs": 1})
    assert outputs(plain, prompts, 6) == want
    engine = llm(directory, num_blocks=40, scheduler={"max_num_seqs": 1}, tiers={"host_bytes": 8 << 20})
    kv = engine.engine.kv
    assert [g.kind for g in kv.groups.groups] == ["full"] + ["sliding 16"] * 5
    assert outputs(engine, prompts, 6) == want  # each prompt evicts the one before it into the host tier
    hierarchy = kv.source("tiers").hierarchy
    assert hierarchy.stats.demoted_blocks > 0
    assert outputs(engine, prompts, 6) == want  # and loads it back
    assert hierarchy.stats.loaded_blocks > 0 and kv.lower_hit_tokens > 0
    kv.block_manager.reset_prefix_cache()
    before = hierarchy.stats.loaded_blocks
    [out] = engine.generate([prompts[0]], Params(max_tokens=6, temperature=0, ignore_eos=True))
    assert out.outputs[0].token_ids == want[0] and out.metrics.num_cached_tokens == 5 * 16
    # the full group's 5 blocks and one window block in each of the 5 sliding groups, of 30 a full layout moves
    assert hierarchy.stats.loaded_blocks - before == 5 + 5
    stats = engine.engine.stats()  # (read off the engine thread when the request was queued: tiers.load_timeout_s)
    assert stats.prefetch_used > 0
    kv.block_manager.check_invariants()


def test_a_restarted_engine_hits_every_group_the_disk_tier_wrote(gemma3, tmp_path):
    directory, prompts, want = gemma3
    first = llm(directory, num_blocks=40, tiers={"disk_path": str(tmp_path), "disk_bytes": 16 << 20})
    assert outputs(first, prompts[:1], 6) == want[:1]
    first.engine.kv.block_manager.reset_prefix_cache()
    first.engine.kv.source("tiers").hierarchy.close()
    second = llm(directory, num_blocks=40, tiers={"disk_path": str(tmp_path), "disk_bytes": 16 << 20})
    [out] = second.generate([prompts[0]], Params(max_tokens=6, temperature=0, ignore_eos=True))
    assert out.outputs[0].token_ids == want[0] and out.metrics.num_cached_tokens == 5 * 16
    assert second.engine.kv.source("tiers").hierarchy.stats.tiers["disk"].loaded_blocks == 10


def test_two_engines_share_a_hybrid_prefix_through_redis(gemma3):
    """The shared tier holds every group's blocks under keys any server computes: a second server loads the first
    one's prompt, the full group's prefix and a window per sliding group, and gives transformers' tokens."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    directory, prompts, want = gemma3
    server = start_redis()
    try:
        writer = llm(directory, num_blocks=40, tiers={"remote_url": server.url})
        assert outputs(writer, prompts[:1], 6) == want[:1]
        writer.engine.kv.block_manager.reset_prefix_cache()
        reader = llm(directory, num_blocks=40, tiers={"remote_url": server.url})
        [out] = reader.generate([prompts[0]], Params(max_tokens=6, temperature=0, ignore_eos=True))
        assert out.outputs[0].token_ids == want[0] and out.metrics.num_cached_tokens == 5 * 16
        assert reader.engine.kv.source("tiers").hierarchy.stats.tiers["redis"].loaded_blocks == 5 + 5
    finally:
        server.kill()
