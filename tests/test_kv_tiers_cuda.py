"""Lower KV tiers under a device pool on a CUDA GPU: an evicted prompt's blocks go to host memory (page-locked
staging) or disk and come back into the GPU's pool bit-exact, so its greedy tokens equal a cold run's. Skips
without a CUDA GPU (bench/gpu_check.sh runs it on one)."""

from __future__ import annotations

import pytest
import torch

from tests.test_kv_tiers_engine import BLOCK, A, B, C, make_llm, run

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="a device pool on CUDA needs a CUDA GPU")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiers-cuda") / "model", "llama")


@pytest.mark.parametrize("layered", [True, False], ids=["layer-by-layer", "whole"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_evicted_prompt_comes_back_into_the_gpu_pool(model_dir, tier, layered, tmp_path):
    """kv_pool.layer_loads auto is on for a CUDA pool: the load goes through the copy stream and the Triton copy
    (the page-locked staging rows read in place); `whole` turns it off for this engine's loads."""
    cold = run(make_llm(model_dir, DEVICE), A)[0]
    tiers = {"host": dict(host_bytes=1 << 20), "disk": dict(host_bytes=0, disk_path=str(tmp_path),
                                                            disk_bytes=64 << 20)}[tier]
    llm = make_llm(model_dir, DEVICE, **tiers)
    pool = llm.engine.runner.pool
    assert pool.device.type == DEVICE
    loads = pool.layer_loads
    assert loads is not None  # auto on a CUDA pool with Triton
    if not layered:
        pool.layer_loads = None
    for tokens in (A, B, C):  # B and C need the pool: A's cached blocks are demoted
        run(llm, tokens)
    hierarchy = llm.engine.kv.source("tiers").hierarchy
    assert hierarchy.stats.demoted_blocks >= 5
    assert run(llm, A) == (cold, 5 * BLOCK)
    assert hierarchy.stats.tiers[tier].loaded_blocks == 5
    assert loads.loads == (1 if layered else 0) and not loads.pending
    llm.engine.kv.block_manager.check_invariants()


def test_a_closed_engine_unpins_its_host_tier_and_the_next_engine_runs(model_dir):
    """The host tier's slab is page-locked in place (cudaHostRegister); closing it unregisters before unmapping, so
    a second engine's allocations (which may land on the same addresses) work."""
    cold = run(make_llm(model_dir, DEVICE), A)[0]
    first = make_llm(model_dir, DEVICE, host_bytes=1 << 20)
    assert first.engine.kv.source("tiers").hierarchy.stores[0].pinned
    run(first, A)
    first.close()
    second = make_llm(model_dir, DEVICE, host_bytes=1 << 20)
    assert second.engine.kv.source("tiers").hierarchy.stores[0].pinned
    assert run(second, A) == (cold, 0)
