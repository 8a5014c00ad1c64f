"""KV tier stores against the raw operation under them, measured in the same run.

    python bench/tiers_raw.py --blocks 64 --json out/tiers_raw.json

Host tier put/get vs a raw torch copy of the same bytes (put: what the caller waits for — the
checksums of a put of 4 MiB or more follow on the tier's own thread; put + checksums: until they
are all taken; put, crc inline / on thread: either way forced); disk tier put/get vs raw
os.pwrite/os.preadv of the same bytes to a file in the same directory. Both disk sides go
through the page cache (no fsync, reads of just-written data), so "disk" here is the tier's
software cost over the kernel's, not the device's speed. CRC32C alone is shown because every
tier read checks one (and host puts take one). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import crc32c
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_runtime.tiers import DiskTier, HostTier
from sage_infer.prefix_reuse.hashing import hash_token_blocks, make_extra_key


def best_seconds(fn, repeats: int, setup=None) -> float:
    """Best of `repeats` timed runs of fn() (after one warm-up); `setup()` runs untimed before each."""
    best = float("inf")
    for i in range(repeats + 1):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i:
            best = min(best, elapsed)
    return best


def measure(schema: KVCacheSchema, n: int, repeats: int, directory: Path) -> list[dict]:
    bpb = schema.bytes_per_block
    total = n * bpb
    keys = hash_token_blocks(list(range(n * schema.block_size)), schema.block_size, make_extra_key("m", "r", "bf16"))
    blocks = torch.randint(0, 256, (n, bpb), dtype=torch.uint8)
    out = torch.empty_like(blocks)
    rows: list[dict] = []

    def row(tier: str, op: str, seconds: float, peer: str, peer_seconds: float) -> None:
        rows.append({"tier": tier, "op": op, "gb_s": total / seconds / 1e9, "peer": peer,
                     "peer_gb_s": total / peer_seconds / 1e9, "ratio_to_peer": peer_seconds / seconds})

    # peers: the raw operations
    memcpy_s = best_seconds(lambda: out.copy_(blocks), repeats)
    crc_s = best_seconds(lambda: [crc32c.crc32c(r) for r in blocks.numpy()], repeats)
    raw = directory / "raw.bin"
    fd = os.open(raw, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    data = blocks.numpy()
    out_np = out.numpy()
    write_s = best_seconds(lambda: [os.pwrite(fd, data[i], i * bpb) for i in range(n)], repeats,
                           setup=lambda: os.ftruncate(fd, 0))
    read_s = best_seconds(lambda: [os.preadv(fd, [out_np[i]], i * bpb) for i in range(n)], repeats)
    os.close(fd)
    raw.unlink()
    row("-", "crc32c", crc_s, "torch copy", memcpy_s)

    # host tier
    host = HostTier(schema, total)
    reset = lambda: (host.drain(), host.delete(keys))  # noqa: E731
    row("host", "put", best_seconds(lambda: host.put(keys, blocks), repeats, setup=reset), "torch copy", memcpy_s)
    row("host", "put + checksums", best_seconds(lambda: (host.put(keys, blocks), host.drain()), repeats,
                                                setup=reset), "torch copy", memcpy_s)
    for op, variant in (("put, crc inline", {"background_crc": False}),
                        ("put, crc on thread", {"background_min_bytes": 0})):
        other = HostTier(schema, total, **variant)
        seconds = best_seconds(lambda tier=other: tier.put(keys, blocks), repeats,
                               setup=lambda tier=other: (tier.drain(), tier.delete(keys)))
        row("host", op, seconds, "torch copy", memcpy_s)
        other.close()
    host.drain()
    row("host", "get_prefix(out=)", best_seconds(lambda: host.get_prefix(keys, out=out), repeats),
        "torch copy", memcpy_s)
    row("host", "get", best_seconds(lambda: host.get(keys), repeats), "torch copy", memcpy_s)
    host.close()

    # disk tier: a fresh directory for each put so every repeat writes the same bytes
    tiers: list[DiskTier] = []

    def fresh_disk() -> None:
        for old in tiers:
            old.close()
            shutil.rmtree(old.directory)
        tiers[:] = [DiskTier(schema, tempfile.mkdtemp(dir=directory), 4 * total, max_pending_bytes=2 * total)]

    row("disk", "put (queued)", best_seconds(lambda: tiers[0].put(keys, blocks), repeats, setup=fresh_disk),
        "raw pwrite", write_s)
    row("disk", "put + flush", best_seconds(lambda: (tiers[0].put(keys, blocks), tiers[0].flush()), repeats,
                                            setup=fresh_disk), "raw pwrite", write_s)
    row("disk", "get_prefix(out=)", best_seconds(lambda: tiers[0].get_prefix(keys, out=out), repeats),
        "raw preadv", read_s)
    assert torch.equal(out, blocks)
    fresh_disk()
    tiers[0].close()
    shutil.rmtree(tiers[0].directory)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=64, help="blocks per batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the disk tier writes (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    schema = KVCacheSchema(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                           block_size=args.block_size)
    directory = Path(tempfile.mkdtemp(prefix="sage-tiers-bench-", dir=args.dir))
    try:
        rows = measure(schema, args.blocks, args.repeats, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    mib = schema.bytes_per_block / 2**20
    print(f"{args.blocks} blocks of {mib:.2f} MiB ({args.blocks * mib:.0f} MiB per batch), "
          f"torch threads {torch.get_num_threads()}, best of {args.repeats}")
    print(f"{'tier':<5} {'op':<17} {'GB/s':>7}  {'peer':<11} {'peer GB/s':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r['tier']:<5} {r['op']:<17} {r['gb_s']:>7.2f}  {r['peer']:<11} {r['peer_gb_s']:>9.2f} "
              f"{r['ratio_to_peer']:>6.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "bytes_per_block": schema.bytes_per_block, "blocks": args.blocks}
        args.json.write_text(json.dumps({**meta, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
