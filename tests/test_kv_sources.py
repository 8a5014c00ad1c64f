"""The `KVSource` seam: a source given to `KVCacheManager` serves prompt blocks and hears the device's hits,
computed blocks, holds, promotions and shutdown through its own class alone."""

from __future__ import annotations

import ast
import inspect

import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.sequence import Sequence
from sage_infer.kv_policy import make_policy
from sage_infer.kv_runtime import kv_cache_manager
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.kv_cache_manager import KVCacheManager
from sage_infer.kv_runtime.pool import make_kv_pool
from sage_infer.kv_runtime.sources import KVSource
from sage_infer.prefix_reuse.hashing import hash_token_blocks
from sage_infer.prefix_reuse.index import PrefixMatch, PrefixReuseIndex

BS = 4
KEY = b"k"
SCHEMA = KVCacheSchema(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS)


class DictSource(KVSource):
    """Blocks kept by chained hash in a dict: the smallest source that serves prompts."""

    name = "dict"

    def __init__(self, pool, rows: dict[bytes, torch.Tensor]) -> None:
        self.pool, self.rows = pool, rows

    def claims(self, seq: Sequence) -> bool:
        return True

    def lookup(self, seq: Sequence, match: PrefixMatch, max_blocks: int | None, now: float) -> None:
        parent = match.block_hashes[-1] if match.block_hashes else None
        rest = seq.token_ids[len(match.block_ids) * BS : match.num_query_blocks * BS]
        keys = []
        for key in hash_token_blocks(rest, BS, seq.extra_key, parent):
            if key not in self.rows:
                break
            keys.append(key)
        match.lower_block_hashes, match.num_lower_tokens = keys, len(keys) * BS

    def take(self, seq: Sequence, match: PrefixMatch, now: float) -> torch.Tensor | None:
        return torch.stack([self.rows[key] for key in match.lower_block_hashes]) if match.lower_block_hashes else None


class RecordingSource(KVSource):
    """Claims nothing; records the hooks the manager calls."""

    name = "recording"

    def __init__(self, keeps: bool = False) -> None:
        self.keeps, self.calls = keeps, []

    def on_hit(self, match: PrefixMatch) -> None:
        self.calls.append(("hit", list(match.block_hashes)))

    def on_computed(self, block_hashes: list[bytes], block_ids: list[int]) -> None:
        self.calls.append(("computed", list(block_hashes)))

    def hold(self, seq: Sequence) -> bool:
        self.calls.append(("hold", seq.seq_id))
        return self.keeps

    def promote(self, limit: int) -> int:
        return limit

    def persist(self) -> tuple[int, int]:
        return 3, 1


def block_manager(num_blocks: int = 8) -> BlockManager:
    return BlockManager(num_blocks, BS, PrefixReuseIndex(BS, make_policy("lru")))


def seq_of(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), len(tokens), SamplingParams(), KEY)


def admit_all(kv: KVCacheManager, seq: Sequence) -> None:
    match = kv.match(seq)
    assert kv.admit(seq, match, seq.num_tokens - match.total_tokens)


def test_a_new_source_serves_a_prompts_blocks_into_the_device_pool():
    pool = make_kv_pool(SCHEMA, 8)
    tokens = list(range(9))
    rows = torch.randint(0, 255, (2, pool.block_nbytes), dtype=torch.uint8)
    source = DictSource(pool, dict(zip(hash_token_blocks(tokens, BS, KEY), rows)))
    kv = KVCacheManager(block_manager(), sources=[source])
    seq = seq_of(tokens)
    admit_all(kv, seq)
    assert seq.num_computed_tokens == 8 and seq.num_cached_tokens == 8
    assert torch.equal(pool.read_blocks(seq.block_table[:2]).view(torch.uint8).reshape(2, -1), rows)
    assert kv.index.match(tokens, KEY, record=False).num_tokens == 8  # registered: the next request hits the device


def test_every_source_hears_the_devices_hits_and_newly_computed_blocks():
    source = RecordingSource()
    kv = KVCacheManager(block_manager(), sources=[source])
    first = seq_of(list(range(9)))
    admit_all(kv, first)
    first.num_computed_tokens = 9
    kv.commit(first)
    hashes = hash_token_blocks(list(range(9)), BS, KEY)
    assert source.calls == [("hit", []), ("computed", hashes)]
    admit_all(kv, seq_of(list(range(9)), 1))
    assert source.calls[-1] == ("hit", hashes)


def test_a_held_sequence_keeps_its_blocks_only_when_a_source_holds_it():
    kept, dropped = RecordingSource(keeps=True), RecordingSource()
    for source, used in ((kept, 3), (dropped, 0)):
        kv = KVCacheManager(block_manager(), sources=[source])
        seq = seq_of(list(range(9)))
        admit_all(kv, seq)
        kv.hold(seq)
        assert source.calls[-1] == ("hold", 0) and kv.block_manager.num_used_blocks == used


def test_promotion_and_persistence_are_the_sources_work_summed():
    kv = KVCacheManager(block_manager(), sources=[RecordingSource(), RecordingSource()])
    assert kv.promote_hot(limit=2) == 4
    assert kv.persist() == (6, 2)
    assert KVCacheManager(block_manager()).persist() == (0, 0)


def test_the_manager_imports_and_reads_no_particular_source():
    tree = ast.parse(inspect.getsource(kv_cache_manager))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert imported.isdisjoint({"sage_infer.kv_runtime.hierarchy", "sage_infer.kv_runtime.transfers",
                                "sage_infer.kv_runtime.tier_source", "sage_infer.kv_runtime.transfer_source",
                                "sage_infer.kv_runtime.loader"})
    assert read.isdisjoint({"hierarchy", "transfers", "loader", "migrator"})
