"""Lower-tier reads land in kept staging buffers (`kv_runtime.staging`): a buffer serves the next read only
after its rows were written into the pool, never while a read (an abandoned one too) may still write it, and
what comes back through a reused buffer is the blocks' own bytes."""

from __future__ import annotations

import torch

from sage_infer.kv_runtime.staging import LENT_TRACKED, ROUND_ROWS, StagingBuffers
from tests.test_kv_migrator_batch import BPB, evict, setup
from tests.test_kv_tiers_engine import A, B, C, cold, make_llm, model_dir, run  # noqa: F401 - fixtures


def test_a_released_buffer_serves_the_next_acquire_and_a_held_one_does_not():
    staging = StagingBuffers(row_bytes=32)
    first = staging.acquire(10)
    assert first.shape == (ROUND_ROWS, 32)
    held = staging.acquire(10)  # `first` not released: another buffer
    assert held.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    staging.release(first[:7])  # released through a view of its rows, as admission hands them back
    again = staging.acquire(ROUND_ROWS)
    assert again.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    assert staging.reused == 1 and staging.allocated == 2
    bigger = staging.acquire(ROUND_ROWS + 1)  # does not fit the kept one
    assert bigger.shape[0] == 2 * ROUND_ROWS


def test_release_ignores_what_it_did_not_lend_and_keeps_within_its_budget():
    staging = StagingBuffers(row_bytes=32, retain_bytes=3 * ROUND_ROWS * 32, retain_buffers=2)
    staging.release(torch.zeros((4, 32), dtype=torch.uint8))  # not a staging buffer
    staging.release(None)
    assert staging.kept_bytes == 0
    a, b, c = staging.acquire(ROUND_ROWS), staging.acquire(2 * ROUND_ROWS), staging.acquire(ROUND_ROWS)
    for buffer in (a, b, c):
        staging.release(buffer)
    assert staging.kept_bytes <= 3 * ROUND_ROWS * 32  # the largest that fit: b, then one small one
    assert sorted(buf.shape[0] for buf in staging._free) == [ROUND_ROWS, 2 * ROUND_ROWS]
    huge = StagingBuffers(row_bytes=32, retain_bytes=32 * ROUND_ROWS)
    big = huge.acquire(2 * ROUND_ROWS)  # above the budget: its own buffer, never kept
    huge.release(big)
    assert huge.kept_bytes == 0


def test_buffers_never_released_are_forgotten_not_reused():
    staging = StagingBuffers(row_bytes=32)
    lent = [staging.acquire(1) for _ in range(LENT_TRACKED + 2)]  # abandoned loads: never released
    staging.release(lent[0])  # (forgotten by now: a release of it is ignored)
    assert staging.kept_bytes == 0
    staging.release(lent[-1])
    assert staging.acquire(1).untyped_storage().data_ptr() == lent[-1].untyped_storage().data_ptr()


def test_a_hierarchy_fetch_reuses_the_released_buffer_and_returns_the_blocks_bytes(tmp_path):
    pool, host, disk, hierarchy = setup(tmp_path, host_blocks=8)
    keys, rows = evict(pool, hierarchy, 4, "a")
    got = hierarchy.fetch(keys)
    assert torch.equal(got, rows)
    first = got.untyped_storage().data_ptr()
    pool.write_rows([0, 1, 2, 3], got)
    hierarchy.release(got)
    keys2, rows2 = evict(pool, hierarchy, 3, "b")  # other blocks, read into the same buffer
    got2 = hierarchy.fetch(keys2)
    assert got2.untyped_storage().data_ptr() == first and torch.equal(got2, rows2)
    assert hierarchy.staging.reused == 1
    assert hierarchy.fetch([b"\x00" * 32]).shape == (0, BPB)  # a miss hands its buffer straight back
    assert hierarchy.staging.kept_bytes > 0
    hierarchy.close()


def test_the_engine_loads_a_prompt_twice_through_one_kept_buffer(model_dir, cold):  # noqa: F811
    llm = make_llm(model_dir, host_bytes=1 << 20)
    hierarchy = llm.engine.kv.source("tiers").hierarchy
    for _ in range(2):
        for tokens in (A, B, C):  # A's blocks are evicted into the host tier
            run(llm, tokens)
        assert run(llm, A)[0] == cold  # and loaded back
    assert hierarchy.stats.tiers["host"].loaded_blocks >= 10
    assert hierarchy.staging.reused >= 1 and hierarchy.staging.kept_bytes > 0
    llm.engine.kv.block_manager.check_invariants()


def test_a_buffer_never_released_is_freed_with_its_last_reference():
    """The books hold what they lent weakly: a view of the rows still brings the buffer back, and a buffer nobody
    refers to any more is freed, not kept by the books."""
    import gc
    import weakref

    staging = StagingBuffers(row_bytes=32)
    abandoned = staging.acquire(4)  # an abandoned load's: never released
    view = abandoned[:2]
    del abandoned
    gc.collect()
    staging.release(view)  # while a view lives, the buffer can still come back
    assert staging.kept_bytes == ROUND_ROWS * 32
    other = staging.acquire(4)
    assert other.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
    staging2 = StagingBuffers(row_bytes=32)
    lost = staging2.acquire(4)
    gone = weakref.ref(lost)
    del lost
    gc.collect()
    assert gone() is None  # the books did not keep it alive
