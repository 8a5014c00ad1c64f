"""Remote KV tiers, batch put/get of one chain: RedisTier vs MooncakeTier, in the same run.

    PYTHONPATH=$PWD python bench/tiers_remote.py --blocks 64 --block-kib 64 --json out/tiers_remote.json

Without --redis/--mooncake URLs it starts a loopback redis-server and mooncake_master (the test
fixtures; a missing one is skipped, with the reason). One `put` of a fresh chain of n blocks,
then one `get_prefix` of it (into a preallocated buffer), best of --repeats after --warmup
untimed rounds (a fresh Mooncake segment pays page faults on first touch); GB/s counts
payload bytes. On loopback with one Mooncake member, Mooncake's "transfer" is a local memcpy
into the segment this process mounted, so this measures each tier's per-call software cost,
not a network.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.prefix_reuse.hashing import hash_token_blocks, make_extra_key


def chain(schema: KVCacheSchema, n: int, salt: str) -> list[bytes]:
    tokens = list(range(n * schema.block_size))
    return hash_token_blocks(tokens, schema.block_size, make_extra_key("bench", "r", "bf16", cache_salt=salt))


def measure(tier, schema: KVCacheSchema, n: int, repeats: int, warmup: int) -> dict:
    blocks = torch.randint(0, 256, (n, schema.bytes_per_block), dtype=torch.uint8)
    out = torch.empty_like(blocks)
    put_s, get_s = float("inf"), float("inf")
    for i in range(warmup + repeats):
        keys = chain(schema, n, f"{tier.name}-{i}-{time.time()}")
        start = time.perf_counter()
        tier.put(keys, blocks)
        put = time.perf_counter() - start
        start = time.perf_counter()
        got = tier.get_prefix(keys, out=out)
        get = time.perf_counter() - start
        assert torch.equal(got, blocks), "a tier returned different bytes"
        tier.delete(keys)
        if i >= warmup:
            put_s, get_s = min(put_s, put), min(get_s, get)
    total = n * schema.bytes_per_block
    return {"tier": tier.name, "blocks": n, "block_bytes": schema.bytes_per_block,
            "put_ms": put_s * 1e3, "get_ms": get_s * 1e3,
            "put_gb_s": total / put_s / 1e9, "get_gb_s": total / get_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=64, choices=[16, 32, 64, 128, 256])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=8,
                        help="untimed rounds first: Mooncake's segment pages are touched on first use")
    parser.add_argument("--redis", help="redis:// URL (default: start a loopback redis-server)")
    parser.add_argument("--mooncake", help="mooncake:// URL (default: start a loopback mooncake_master)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    schema = KVCacheSchema(num_layers=2, num_kv_heads=args.block_kib // 8, head_dim=64, block_size=16)
    assert schema.bytes_per_block == args.block_kib << 10
    capacity = 4 * args.blocks * schema.bytes_per_block
    rows, cleanup, skipped = [], [], []

    from sage_infer.kv_runtime.tiers import MooncakeTier, RedisTier

    for kind, make in (("redis", lambda url: RedisTier(schema, url, capacity)),
                       ("mooncake", lambda url: MooncakeTier(schema, url + "?timeout=10", capacity))):
        url = getattr(args, kind)
        try:
            if url is None:
                if kind == "redis":
                    from tests.redis_fixture import start_redis as start
                else:
                    from tests.mooncake_fixture import start_master as start
                server = start()
                cleanup.append(server)
                url = server.url
            tier = make(url)
        except BaseException as err:  # noqa: BLE001 - pytest.skip raises a BaseException
            skipped.append(f"{kind}: {err}")
            continue
        try:
            rows.append(measure(tier, schema, args.blocks, args.repeats, args.warmup))
        finally:
            tier.close(**({"wait": True} if kind == "mooncake" else {}))
    for server in cleanup:
        server.kill()
    print(f"{args.blocks} blocks x {args.block_kib} KiB, one batch call each, best of {args.repeats}")
    print(f"{'tier':<10}{'put ms':>9}{'put GB/s':>10}{'get ms':>9}{'get GB/s':>10}")
    for r in rows:
        print(f"{r['tier']:<10}{r['put_ms']:>9.2f}{r['put_gb_s']:>10.2f}{r['get_ms']:>9.2f}{r['get_gb_s']:>10.2f}")
    for line in skipped:
        print(f"skipped {line}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=2))


if __name__ == "__main__":
    main()
