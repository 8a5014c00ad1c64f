"""What an allocation that must evict costs, with running requests holding most of the pool, per eviction policy.

    python bench/eviction_cost.py --blocks 2000,20000,200000 --json out/eviction_cost.json
    python bench/eviction_cost.py --retained 0.5 ...     # half the pool's chains retained conversations instead

A pool of N blocks, every block registered in chains of 64 (sequences); the oldest `--cached` share of the chains
finished (their blocks cached, evictable leaf first), the rest still running (held). Then `--allocations` blocks
are allocated one at a time, each evicting a cached block, after one untimed such allocation; with `--retained R`
the newest R share of the chains are finished too and retained (`kv_runtime.retention`, as stored Responses API
conversations are), evicted only when nothing else is left (the heap-ordered
policies drop the stale entries of the keys taken since their last victim there, once per hold). The peer, in the
same run: the same allocations from the free list of a pool with room (no eviction). Prints microseconds per
allocation and the ratio; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from sage_infer.kv_policy import POLICIES, make_policy
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.retention import KVRetention
from sage_infer.prefix_reuse import PrefixReuseIndex, make_extra_key

KEY = make_extra_key("bench", "local", "bf16")
BS = 16
CHAIN = 64


def filled(policy: str, blocks: int, cached: float, retained: float = 0.0) -> BlockManager:
    """A pool of `blocks`, all registered in chains; the oldest `cached` share released, the newest `retained` share
    released and retained."""
    manager = BlockManager(blocks, BS, PrefixReuseIndex(BS, make_policy(policy)))
    if retained:
        manager.retention = KVRetention(blocks)
    chains, token = [], 0
    for _ in range(blocks // CHAIN):
        ids, parent = manager.allocate(CHAIN, KEY), None
        for i, block in enumerate(ids):
            ids[i], parent = manager.cache_block(block, parent, list(range(token, token + BS)), KEY)
            token += BS
        chains.append(ids)
    for ids in chains[: max(1, int(len(chains) * cached))]:
        manager.free(list(reversed(ids)))
    for n, ids in enumerate(chains[len(chains) - int(len(chains) * retained):]):
        manager.free(list(reversed(ids)))
        manager.retention.retain(f"conversation {n}", [manager.index.hash_of(b) for b in ids], ttl_s=3600)
    return manager


def per_allocation_us(manager: BlockManager, n: int) -> float:
    manager.allocate(1, KEY)  # (warm-up, untimed)
    start = time.perf_counter()
    for _ in range(n):
        manager.allocate(1, KEY)
    return (time.perf_counter() - start) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="2000,20000,200000")
    parser.add_argument("--policies", default=",".join(p for p in POLICIES if p != "opt"))
    parser.add_argument("--cached", type=float, default=0.1, help="share of the chains finished (cached)")
    parser.add_argument("--retained", type=float, default=0.0, help="share of the chains finished and retained")
    parser.add_argument("--allocations", type=int, default=1000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    print(f"{'policy':8} {'blocks':>8} {'us/alloc':>10} {'free list us':>13} {'ratio':>8}")
    for blocks in (int(b) for b in args.blocks.split(",")):
        n = min(args.allocations, int(blocks // CHAIN * args.cached) * CHAIN - 1)
        peer = BlockManager(blocks + n + 1, BS, PrefixReuseIndex(BS, make_policy("lru")))
        peer.allocate(blocks, KEY)
        free_us = per_allocation_us(peer, n)
        for policy in args.policies.split(","):
            us = per_allocation_us(filled(policy, blocks, args.cached, args.retained), n)
            rows.append({"policy": policy, "blocks": blocks, "allocations": n, "us_per_allocation": us,
                         "free_list_us": free_us, "ratio": us / free_us})
            print(f"{policy:8} {blocks:>8} {us:>10.1f} {free_us:>13.2f} {us / free_us:>8.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cached_share": args.cached, "retained_share": args.retained, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
