"""KV pool storage layout: layer-major (what `KVPool` stores) against block-major.

    python bench/kv_pool_layout.py --json out/kv_pool_layout.json

Layouts, same bytes, same API (`store`, `gather_slots`, `gather_blocks`, `read_blocks`,
`write_blocks`, same row format out of `read_blocks`):
  block-major  ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``: one block is one
               contiguous byte range (`BlockMajorPool` below).
  layer-major  ``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]``: one block is
               2 x num_layers strided pieces, each layer's K and V dense (`KVPool` itself).

Two measurements per model shape:
  attention  microseconds per engine step of the pool calls attention makes, all layers:
             a decode step (store 64 tokens, gather_blocks for 4 length-sorted groups of 16
             sequences of 64-640 tokens) and a prefill chunk (store 512 tokens, gather_slots over
             a 1,536-token cached context). Best of `--repeats` loops.
  copy       GB/s moving N random whole blocks out to / in from contiguous rows ``[N, num_layers, 2,
             block_size, KvH, D]``, on plain tensors of each layout with each copy method
             (`index_select` / `index_copy_` on the block axis, or one `copy_` per block), plus
             `KVPool.read_blocks` / `write_blocks` themselves, against a raw torch copy of the same
             number of contiguous bytes (`dst.copy_(src)`). Best of `--repeats`.

Prints two tables and writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sage_infer.core.kv_schema import KVCacheSchema, KVDtype  # noqa: E402
from sage_infer.kv_runtime.pool import KVPool  # noqa: E402

# name -> (schema, pool blocks, blocks per copy)
SHAPES = {
    # bench/engine_vs_hf.py's tiny Llama: 4 layers, 4 KV heads, head_dim 32, fp32 (64 KiB blocks)
    "tiny-llama-fp32": (KVCacheSchema(4, 4, 32, 16, KVDtype.FP32), 4096, 256),
    # Llama-3-8B-like: 32 layers, 8 KV heads, head_dim 128, bf16 (2 MiB blocks)
    "llama8b-bf16": (KVCacheSchema(32, 8, 128, 16, KVDtype.BF16), 256, 32),
}


class BlockMajorPool(KVPool):
    """The block-major layout behind the attention API: ``[num_blocks, num_layers, 2, block_size, KvH, D]``.

    Per-layer access indexes flat (block, layer, K|V) tiles and token rows of the same bytes
    (slot ``s`` of layer 0's K is token row ``s + (s // block_size) * (2 * num_layers - 1) *
    block_size``), gathering into the same workspace as `KVPool`, so only the layout differs.
    """

    def __init__(self, schema: KVCacheSchema, num_blocks: int) -> None:
        super().__init__(schema, 1)  # the base's own storage is not used
        self.num_blocks = num_blocks
        self._bm = torch.zeros((num_blocks, *self.block_shape), dtype=self.dtype)
        self._token_rows = self._bm.view(-1, self.num_kv_heads, self.head_dim)
        self._tiles = self._bm.view(-1, self.block_size, self.num_kv_heads, self.head_dim)
        self._tiles_per_block = 2 * self.num_layers
        self._slot_skip = (self._tiles_per_block - 1) * self.block_size

    def _slot_rows(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.add(slots, torch.div(slots, self.block_size, rounding_mode="floor"), alpha=self._slot_skip)

    def _layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_start = 2 * layer * self.block_size
        return self._token_rows[k_start:], self._token_rows[k_start + self.block_size:]

    def store(self, layer, k, v, slot_mapping):
        rows = self._slot_rows(slot_mapping)
        k_rows, v_rows = self._layer_rows(layer)
        k_rows.index_copy_(0, rows, k.to(self.dtype))
        v_rows.index_copy_(0, rows, v.to(self.dtype))

    def gather_slots(self, layer, slots, dtype):
        rows = self._slot_rows(slots)
        k_rows, v_rows = self._layer_rows(layer)
        return self._select(0, k_rows, rows).to(dtype), self._select(1, v_rows, rows).to(dtype)

    def gather_blocks(self, layer, block_tables, dtype):
        tiles = block_tables.reshape(-1) * self._tiles_per_block
        k_tiles, v_tiles = self._tiles[2 * layer:], self._tiles[2 * layer + 1:]
        shape = (block_tables.shape[0], -1, self.num_kv_heads, self.head_dim)
        return (self._select(0, k_tiles, tiles).view(shape).to(dtype),
                self._select(1, v_tiles, tiles).view(shape).to(dtype))


def block_first_views(schema: KVCacheSchema, num_blocks: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Both layouts as plain tensors, each viewed block-first ``[num_blocks, L, 2, bs, KvH, D]``
    (contiguous for block-major, a strided permutation for layer-major)."""
    inner = (schema.block_size, schema.num_kv_heads, schema.head_dim)
    block_major = torch.randn(num_blocks, schema.num_layers, 2, *inner).to(dtype)
    layer_major = torch.randn(2, schema.num_layers, num_blocks, *inner).to(dtype)
    return {"block-major": block_major, "layer-major": layer_major.permute(2, 1, 0, 3, 4, 5)}


def copy_methods(view: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> dict[str, callable]:
    """Ways to move the blocks `ids` between `view` ([num_blocks, ...]) and `rows` ([n, ...] contiguous)."""
    host_ids = ids.tolist()

    def read_loop() -> None:
        for i, b in enumerate(host_ids):
            rows[i].copy_(view[b])

    def write_loop() -> None:
        for i, b in enumerate(host_ids):
            view[b].copy_(rows[i])

    return {
        "read index_select": lambda: torch.index_select(view, 0, ids, out=rows),
        "read copy_ per block": read_loop,
        "write index_copy_": lambda: view.index_copy_(0, ids, rows),
        "write copy_ per block": write_loop,
    }


def best_seconds(fn, repeats: int, inner: int = 1) -> float:
    fn()  # warm: fault pages in, first-call dispatch
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def attention_step(pool: KVPool, seed: int) -> dict[str, callable]:
    """The pool calls of one decode step and of one prefill chunk, over all layers."""
    rng = random.Random(seed)
    bs, kvh, d = pool.block_size, pool.num_kv_heads, pool.head_dim
    # random block ids, repeats allowed: the big shape's pool is smaller than 64 x 40 blocks, and
    # the copies only need random placement, not distinct blocks
    lens = sorted(rng.randint(64, 640) for _ in range(64))
    tables = [[rng.randrange(pool.num_blocks) for _ in range(-(-n // bs))] for n in lens]
    groups = []
    for g in range(0, 64, 16):  # length-sorted groups of 16, padded to the group's longest (ModelRunner)
        chosen = tables[g:g + 16]
        width = max(map(len, chosen))
        groups.append(torch.tensor([t + [0] * (width - len(t)) for t in chosen]))
    decode_slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens)])
    dk = torch.randn(64, kvh, d).to(pool.dtype)
    prefill_table = rng.sample(range(pool.num_blocks), 2048 // bs)
    ctx_slots = torch.tensor([prefill_table[i // bs] * bs + i % bs for i in range(2048)])
    pk = torch.randn(512, kvh, d).to(pool.dtype)
    compute = pool.dtype

    def decode() -> None:
        for layer in range(pool.num_layers):
            pool.store(layer, dk, dk, decode_slots)
            for table in groups:
                pool.gather_blocks(layer, table, compute)

    def prefill() -> None:
        for layer in range(pool.num_layers):
            pool.store(layer, pk, pk, ctx_slots[1536:])
            pool.gather_slots(layer, ctx_slots, compute)

    return {"decode_step": decode, "prefill_chunk": prefill}


def measure_shape(name: str, repeats: int) -> dict:
    schema, num_blocks, n_copy = SHAPES[name]
    pool = KVPool(schema, num_blocks)
    rng = random.Random(1)
    ids = torch.tensor(rng.sample(range(num_blocks), n_copy))
    nbytes = n_copy * pool.block_nbytes
    out: dict = {"shape": name, "schema": schema.to_dict(), "num_blocks": num_blocks, "block_nbytes": pool.block_nbytes,
                 "copy_blocks": n_copy, "copy_bytes": nbytes, "attention_us": {}, "copy_gb_s": {}}

    pools = {"block-major": BlockMajorPool(schema, num_blocks), "layer-major": pool}
    for label, p in pools.items():
        steps = attention_step(p, seed=2)
        out["attention_us"][label] = {k: best_seconds(fn, repeats, inner=3) * 1e6 for k, fn in steps.items()}
    del pools["block-major"]

    rows = torch.randn(n_copy, *pool.block_shape).to(pool.dtype)
    for label, view in block_first_views(schema, num_blocks, pool.dtype).items():
        out["copy_gb_s"][label] = {m: nbytes / best_seconds(fn, repeats) / 1e9
                                   for m, fn in copy_methods(view, ids, rows).items()}
        del view
    src = rows.clone()
    pool.write_blocks(ids, src)
    assert torch.equal(pool.read_blocks(ids).view(torch.uint8), src.view(torch.uint8)), "round trip not bit-exact"
    out["copy_gb_s"]["KVPool"] = {
        "read_blocks": nbytes / best_seconds(lambda: pool.read_blocks(ids, out=rows), repeats) / 1e9,
        "write_blocks": nbytes / best_seconds(lambda: pool.write_blocks(ids, src), repeats) / 1e9,
    }
    dst = torch.empty_like(src)
    out["copy_gb_s"]["raw torch"] = {"dst.copy_(src)": nbytes / best_seconds(lambda: dst.copy_(src), repeats) / 1e9}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = [measure_shape(name, args.repeats) for name in args.shapes.split(",")]

    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, best of {args.repeats}\n")
    print(f"{'shape':<16} {'layout':<12} {'decode step us':>15} {'prefill chunk us':>17}")
    for r in results:
        for label, t in r["attention_us"].items():
            print(f"{r['shape']:<16} {label:<12} {t['decode_step']:15.1f} {t['prefill_chunk']:17.1f}")
    print()
    print(f"{'shape':<16} {'layout / API':<12} {'copy':<22} {'GB/s':>7}   (N blocks x block bytes)")
    for r in results:
        size = f"{r['copy_blocks']} x {r['block_nbytes'] // 1024} KiB"
        for label, ops in r["copy_gb_s"].items():
            for op, gbs in ops.items():
                print(f"{r['shape']:<16} {label:<12} {op:<22} {gbs:7.2f}   ({size})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        header = {"threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": args.repeats,
                  "cpu": platform.processor() or platform.machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        args.json.write_text(json.dumps({"header": header, "results": results}, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
