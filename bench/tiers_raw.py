"""KV tier stores against the raw operation under them, measured in the same run.

    python bench/tiers_raw.py --json out/tiers_raw.json                  # the sweep: 16 KiB .. 2 MiB blocks
    python bench/tiers_raw.py --sweep-kib "" --blocks 64 --layers 32 ...  # only `measure` at one block shape

`measure` (the CI gate's rows, one block shape): host tier put/get vs a raw torch copy of the same bytes (put:
what the caller waits for — the checksums of a put of 4 MiB or more follow on the tier's own thread; put +
checksums: until they are all taken; put, crc inline / on thread: either way forced); disk tier put/get vs raw
os.pwrite/os.preadv of the same bytes, one call per block, to a file in the same directory. Both disk sides go
through the page cache (no fsync, reads of just-written data), so "disk" here is the tier's software cost over
the kernel's, not the device's speed.

`sweep` (`--sweep-kib`, `--batch-mib`): the same batch bytes in blocks of each size, every tier op ÷ the fastest
raw peer of those bytes: a copy (the better of torch's and numpy's), a gather from a KV pool (`read_blocks`), and
pwritev / preadv in ~1 MiB pieces at queue depth 1 and at the tier's thread count; "batched" ops take the whole
batch in one call, "per block" ops one call per block (what batching saves). Raw disk I/O modes (O_DIRECT,
cold reads) are compared in `bench/tiers_io.py`. Prints tables and writes JSON, with the load average.

The disk tier's puts are measured on a tier that keeps running (so it reuses its written batches' buffers, as a
serving tier does); before each repeat the last one's records are deleted and their segments removed, as the raw
write peer truncates its file before each repeat, so both write into page-cache pages freed just before. (Appending
past what was freed cost far more on the 2-vCPU VM, for a plain pwritev too: 16 MiB appends took 3-8 ms, then ~45 ms
each once ~100 MiB had been appended; the cause was not isolated.) "put + flush" and its peer stop at the page
cache; "put + flush(sync)" is the durable write (the tier's fdatasync of the segment it wrote, and of the directory,
which gained that segment) against pwritev + fdatasync of the same bytes.

`--paths new,old`: each block size runs once per path, alternating, so a loaded machine slows both alike: "new"
is the default data path (the CRC32C method the kernel chose, one-pass disk reads), "old" the crc32 instruction
and the two-pass disk read (preadv, then the CRC).

`--baseline DIR`: each block size runs in a fresh process of this code ("new") and one importing `sage_infer`
from DIR ("base": another checkout, e.g. ``git worktree add /tmp/base <commit>``), alternating, so two versions
of the tiers compare side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import crc32c
import numpy as np
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.kv_runtime.migrator import pool_gather
from sage_infer.kv_runtime.pool import make_kv_pool
from sage_infer.kv_runtime.tiers import DiskTier, HostTier
from sage_infer.kv_runtime.tiers import disk as tier_disk
from sage_infer.kv_runtime.tiers import rows as tier_rows
from sage_infer.kv_runtime.tiers.rows import CACHE_CHUNK, crc_runs, move_pool, set_move_threads
from sage_infer.prefix_reuse.hashing import hash_token_blocks, make_extra_key
from sage_infer.quantization import kv_codec_kernel


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


def disk_puts(tier: DiskTier, keys: list[bytes], blocks: torch.Tensor, gather, repeats: int, sync: bool = False
              ) -> float:
    """Best seconds of put (or put_gather of `gather()`) + flush of `blocks` on a running `tier`; before each
    repeat (untimed) the last one's records are deleted and their segments removed (`compact`), freeing their pages
    as a truncation frees the raw peer's."""

    def clear() -> None:
        tier.delete(keys)
        tier.compact(min_fragmentation=0.99)

    def put() -> None:
        if gather is None:
            tier.put(keys, blocks)
        else:
            tier.put_gather(keys, gather())
        tier.flush(sync=sync)

    return best_seconds(put, repeats, setup=clear)


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
    # (where the one-pass copy + CRC kernel loads, every put checksums inline: the second row is the first again)
    for op, variant in (("put, crc inline", {"background_crc": False}),
                        ("put, crc on thread" if tier_rows.fused_kernel() is None else "put, crc inline (one pass)",
                         {"background_min_bytes": 0})):
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

    # disk tier: one running tier; each repeat's records removed before the next (`disk_puts`)
    disk = DiskTier(schema, tempfile.mkdtemp(dir=directory), 4 * (total + n * 72), max_pending_bytes=2 * total)
    clear = lambda: (disk.flush(), disk.delete(keys), disk.compact(min_fragmentation=0.99))  # noqa: E731
    row("disk", "put (queued)", best_seconds(lambda: disk.put(keys, blocks), repeats, setup=clear),
        "raw pwrite", write_s)
    row("disk", "put + flush", disk_puts(disk, keys, blocks, None, repeats), "raw pwrite", write_s)
    disk.put(keys, blocks)
    disk.flush()
    row("disk", "get_prefix(out=)", best_seconds(lambda: disk.get_prefix(keys, out=out), repeats),
        "raw preadv", read_s)
    assert torch.equal(out, blocks)
    disk.close()
    shutil.rmtree(disk.directory)
    return rows


def raw_io(fd: int, data: np.ndarray, write: bool, depth: int) -> None:
    """pwritev / preadv of `data` ([n, row] uint8) in ~1 MiB pieces at `fd` offset 0, `depth` at a time."""
    per = max(1, CACHE_CHUNK // data.shape[1])
    starts = range(0, data.shape[0], per)

    def piece(first: int) -> None:
        rows = list(data[first : first + per])
        (os.pwritev if write else os.preadv)(fd, rows, first * data.shape[1])

    if depth == 1:
        for first in starts:
            piece(first)
    else:
        list(move_pool().map(piece, starts))


def sweep_one(kib: int, batch_bytes: int, repeats: int, directory: Path, per_block: bool,
              tiers: tuple[str, ...] = ("host", "disk")) -> list[dict]:
    """Every op of `tiers` on `batch_bytes` in blocks of `kib` KiB, against the fastest raw peer of the same
    bytes."""
    schema = KVCacheSchema(num_layers=max(1, kib // 16), num_kv_heads=4, head_dim=64, block_size=16)
    bpb = schema.bytes_per_block
    n = max(1, batch_bytes // bpb)
    total = n * bpb
    keys = hash_token_blocks(list(range(n * 16)), 16, make_extra_key("m", f"{kib}", "bf16"))
    blocks = torch.randint(0, 256, (n, bpb), dtype=torch.uint8)
    out = torch.empty_like(blocks)
    pool = make_kv_pool(schema, n + 8)
    ids = torch.randperm(n + 8)[:n].tolist()  # a request's device blocks, anywhere in the pool
    pool.write_rows(ids, blocks)
    rows: list[dict] = []
    best = lambda fn, setup=None: best_seconds(fn, repeats, setup)  # noqa: E731

    def row(tier: str, op: str, seconds: float, peer: str, peer_s: float) -> None:
        rows.append({"block_kib": kib, "blocks": n, "threads": tier_rows.MOVE_THREADS,
                     "tier": tier, "op": op, "gb_s": total / seconds / 1e9,
                     "peer": peer, "peer_gb_s": total / peer_s / 1e9, "ratio_to_peer": peer_s / seconds})

    copy_s = min(best(lambda: out.copy_(blocks)), best(lambda: np.copyto(out.numpy(), blocks.numpy())))
    gather_s = best(lambda: pool.read_blocks(ids, out=out.view(pool.dtype).view(n, *pool.block_shape)))
    fd = os.open(directory / "raw.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    depths = sorted({1, tier_rows.MOVE_THREADS})
    truncate = lambda: os.ftruncate(fd, 0)  # noqa: E731
    write_s = min(best(lambda d=d: raw_io(fd, blocks.numpy(), True, d), truncate) for d in depths)
    sync_s = min(best(lambda d=d: (raw_io(fd, blocks.numpy(), True, d), os.fdatasync(fd)), truncate) for d in depths)
    raw_io(fd, blocks.numpy(), True, 1)
    read_s = min(best(lambda d=d: raw_io(fd, out.numpy(), False, d)) for d in depths)
    os.close(fd)
    row("-", "crc32c", best(lambda: crc_runs(blocks, [(0, n)])), "raw copy", copy_s)

    if "host" in tiers:
        host_ops(schema, keys, blocks, out, pool, ids, best, row, per_block, copy_s, gather_s)
    if "disk" in tiers:
        disk_ops(schema, keys, blocks, out, pool, ids, best, row, per_block, repeats, directory, write_s, sync_s,
                 read_s)
    return rows


def host_ops(schema, keys, blocks, out, pool, ids, best, row, per_block: bool, copy_s: float, gather_s: float
             ) -> None:
    """The host tier's rows of `sweep_one`."""
    total = blocks.numel()
    host = HostTier(schema, total)
    reset = lambda: (host.drain(), host.delete(keys))  # noqa: E731
    row("host", "put", best(lambda: host.put(keys, blocks), reset), "raw copy", copy_s)
    row("host", "put + checksums", best(lambda: (host.put(keys, blocks), host.drain()), reset), "raw copy", copy_s)
    row("host", "demote: put_gather from pool", best(lambda: (host.put_gather(keys, pool_gather(pool, ids)),
                                                              host.drain()), reset), "pool gather", gather_s)
    row("host", "demote: gather, then put", best(lambda: (host.put(keys, pool.read_blocks(ids)), host.drain()),
                                                 reset), "pool gather", gather_s)
    host.put(keys, blocks)
    host.drain()
    row("host", "get_prefix(out=)", best(lambda: host.get_prefix(keys, out=out)), "raw copy", copy_s)
    assert torch.equal(out, blocks)
    if per_block:
        row("host", "put, per block", best(lambda: [host.put([k], blocks[i : i + 1]) for i, k in enumerate(keys)],
                                           reset), "raw copy", copy_s)
        row("host", "get, per block", best(lambda: [host.get_prefix([k], out=out[i : i + 1])
                                                    for i, k in enumerate(keys)]), "raw copy", copy_s)
    host.close()


def disk_ops(schema, keys, blocks, out, pool, ids, best, row, per_block: bool, repeats: int, directory: Path,
             write_s: float, sync_s: float, read_s: float) -> None:
    """The disk tier's rows of `sweep_one`."""
    n, total = blocks.shape[0], blocks.numel()
    # a running tier; each repeat's records removed before the next (`disk_puts`)
    disk = DiskTier(schema, tempfile.mkdtemp(dir=directory), 4 * (total + n * 72), max_pending_bytes=2 * total)
    row("disk", "put + flush", disk_puts(disk, keys, blocks, None, repeats), "raw pwritev", write_s)
    row("disk", "demote: put_gather + flush", disk_puts(disk, keys, blocks, lambda: pool_gather(pool, ids), repeats),
        "raw pwritev", write_s)
    row("disk", "put + flush(sync)", disk_puts(disk, keys, blocks, None, repeats, sync=True), "pwritev+fdatasync",
        sync_s)
    row("disk", "get_prefix(out=)", best(lambda: disk.get_prefix(keys, out=out)), "raw preadv", read_s)
    assert torch.equal(out, blocks)
    if per_block:
        row("disk", "get, per block", best(lambda: [disk.get_prefix([k], out=out[i : i + 1])
                                                    for i, k in enumerate(keys)]), "raw preadv", read_s)
    disk.close()
    shutil.rmtree(disk.directory)


def sweep_path(path: str, kib: int, batch_bytes: int, repeats: int, directory: Path, per_block: bool,
               tiers: tuple[str, ...] = ("host", "disk")) -> list[dict]:
    """`sweep_one` on the "new" data path (the defaults) or the "old" one (crc32 instruction, two-pass disk reads),
    each row tagged with its path and CRC method."""
    if path not in ("new", "old"):
        raise SystemExit(f"--paths: 'new' or 'old', not {path!r}")
    method = kv_codec_kernel.crc_method()
    if path == "new" or method is None:
        done = sweep_one(kib, batch_bytes, repeats, directory, per_block, tiers)
    else:
        tier_disk.ONE_PASS_READS = False
        try:
            with kv_codec_kernel.crc_method_forced("crc32"):
                method = "crc32"
                done = sweep_one(kib, batch_bytes, repeats, directory, per_block, tiers)
        finally:
            tier_disk.ONE_PASS_READS = True
    return [{**r, "path": path, "crc": method or "package"} for r in done]


def child_sweep(root: Path, label: str, kib: int, threads: int, args: argparse.Namespace, directory: Path
                ) -> list[dict]:
    """The sweep of one block size in a fresh process importing `sage_infer` from `root`, rows tagged `label`."""
    out = directory / f"child-{label}-{kib}.json"
    command = [sys.executable, __file__, "--sweep-kib", str(kib), "--threads", str(threads), "--paths", "new",
               "--tiers", args.tiers, "--batch-mib", str(args.batch_mib), "--repeats", str(args.repeats),
               "--dir", str(directory), "--json", str(out), *(["--per-block"] if args.per_block else [])]
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return [{**r, "path": label} for r in json.loads(out.read_text())["sweep"]["results"]]


def print_rows(rows: list[dict], with_block: bool) -> None:
    head = f"{'tier':<5} {'op':<29} {'GB/s':>6}  {'peer':<17} {'peer GB/s':>9} {'ratio':>6}"
    print(f"{'KiB':>5} {'path':<4} " * with_block + head)
    for r in rows:
        print((f"{r['block_kib']:>5} {r['path']:<4} " if with_block else "")
              + f"{r['tier']:<5} {r['op']:<29} {r['gb_s']:>6.2f}  "
              f"{r['peer']:<17} {r['peer_gb_s']:>9.2f} {r['ratio_to_peer']:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep-kib", default="16,256,2048", help="block sizes of the sweep ('' = no sweep)")
    parser.add_argument("--batch-mib", type=int, default=16, help="sweep: bytes per batch, the same at every size")
    parser.add_argument("--per-block", action="store_true", help="sweep: also one call per block")
    parser.add_argument("--paths", default="new", help="sweep: data paths to alternate, 'new' and/or 'old'")
    parser.add_argument("--tiers", default="host,disk", help="sweep: the tiers whose ops run")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="sweep: a checkout of sage_infer to compare with, block size by block size, alternating "
                             "fresh processes (rows 'base' and 'new')")
    parser.add_argument("--threads", default=f"{tier_rows.MOVE_THREADS},2",
                        help="sweep: row-moving threads to try, each a pass (default: this machine's default, and 2)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=0, help="measure: blocks per batch (0 = skip measure)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the disk tier writes (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="sage-tiers-bench-", dir=args.dir))
    load = os.getloadavg()[0]
    report: dict = {"torch": torch.__version__, "default_threads": tier_rows.MOVE_THREADS, "load_average_1m": load,
                    "crc_method": kv_codec_kernel.crc_method()}
    try:
        if args.blocks:
            schema = KVCacheSchema(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                                   block_size=args.block_size)
            report["measure"] = {"bytes_per_block": schema.bytes_per_block, "blocks": args.blocks,
                                 "results": measure(schema, args.blocks, args.repeats, directory)}
            print(f"{args.blocks} blocks of {schema.bytes_per_block / 2**20:.2f} MiB, best of {args.repeats}")
            print_rows(report["measure"]["results"], False)
        sizes = [int(k) for k in args.sweep_kib.split(",") if k.strip()]
        report["sweep"] = {"batch_mib": args.batch_mib, "results": []}
        for threads in dict.fromkeys(int(t) for t in args.threads.split(",")) if sizes else ():
            set_move_threads(threads)
            done = []
            for i, kib in enumerate(sizes):
                if args.baseline is not None:  # alternating which goes first, so a drift in load hits both alike
                    sides = [(Path(__file__).resolve().parents[1], "new"), (args.baseline.resolve(), "base")]
                    for root, label in sides[:: 1 if i % 2 == 0 else -1]:
                        done += child_sweep(root, label, kib, threads, args, directory)
                    continue
                for path in args.paths.split(","):
                    done += sweep_path(path.strip(), kib, args.batch_mib << 20, args.repeats, directory,
                                       args.per_block, tuple(args.tiers.split(",")))
            report["sweep"]["results"] += done
            print(f"\nsweep: {args.batch_mib} MiB per batch, best of {args.repeats}, {threads} row threads, "
                  f"CRC32C by {kv_codec_kernel.crc_method() or 'the crc32c package'}"
                  + ("" if args.baseline else " (new), crc32 (old)"))
            print_rows(done, True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report["load_average_1m_after"] = os.getloadavg()[0]
    print(f"load average (1 min) {load:.2f} before, {report['load_average_1m_after']:.2f} after, "
          f"{os.cpu_count()} cores")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
