"""A tier hit's rows into a GPU pool: the layer-wise Triton copy (`kv_runtime/layer_loads.py`) against a plain
host-to-device copy of the same bytes, in one run.

    python bench/layer_copy.py --json out/layer_copy_cuda.json            # on an NVIDIA GPU
    python bench/layer_copy.py --device cpu --blocks 64,1024               # a CPU pool's layer-by-layer copies

Method
  Shape      the 0.5B shape's KV (24 layers, 2 KV heads x 64, bf16, blocks of 16 tokens: 192 KiB a block) by
             default (`--layers`, `--kv-heads`, `--head-dim`, `--dtype`); `--blocks` blocks of rows, page-locked
             (`pin_memory`), as a tier read leaves them in a staging buffer, into a pool of twice as many blocks
             at shuffled block ids.
  layered    `LayerLoads.add` of the rows and the device synchronized: one Triton launch per layer on the copy
             stream, each reading its layer's slices of every row from host memory in place.
  copy       the rows copied whole into a device buffer allocated once (`copy_(non_blocking=True)` from page-locked
             memory, one DMA; on a CPU a host copy), then synchronized: what moving the same bytes costs without a
             scatter into blocks.
  whole      the engine's whole load: `KVPool.write_rows` (the rows to the device, then one `index_copy_` into the
             blocks), synchronized.
  Each best of `--repeats` rounds, the three alternating; GB/s = the rows' bytes / time; ratios to copy.
  `--device cpu`: a CPU pool's `layer_loads: on` (one PyTorch copy per layer) against the same peers.
  Every pool's contents are checked against `write_rows`'s.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._report import write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (a CPU pool's layer-by-layer copies)")
    parser.add_argument("--blocks", default="256,1024,4096", help="blocks per load, comma-separated")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    from sage_infer.core.kv_schema import KVCacheSchema, KVDtype
    from sage_infer.kv_runtime.pool import KVPool

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    schema = KVCacheSchema(num_layers=args.layers, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                           block_size=args.block_size, dtype={"bf16": KVDtype.BF16, "fp16": KVDtype.FP16,
                                                              "fp32": KVDtype.FP32}[args.dtype])

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    rows_out = []
    for n in (int(x) for x in args.blocks.split(",")):
        layered, whole, check = (KVPool(schema, 2 * n, device=device) for _ in range(3))
        layered.enable_layer_loads()
        gen = torch.Generator().manual_seed(n)
        rows = torch.randint(0, 255, (n, layered.block_nbytes), dtype=torch.uint8, generator=gen)
        rows = rows.view(layered.dtype).nan_to_num_(0.0).view(torch.uint8)  # (random bytes: no NaN patterns)
        if cuda:
            rows = rows.pin_memory()
        ids = random.Random(n).sample(range(2 * n), n)
        check.write_rows(ids, rows)
        dst = torch.empty_like(rows, device=device)  # the copy's destination, allocated (and touched) once
        dst.fill_(0)
        times: dict[str, list[float]] = {"layered": [], "copy": [], "whole": []}
        for _ in range(args.repeats):
            for mode in times:
                sync()
                start = time.perf_counter()
                if mode == "layered":
                    layered.load_rows(ids, rows, lambda _rows: None)
                    layered.finish_loads()
                elif mode == "copy":
                    dst.copy_(rows, non_blocking=True)
                else:
                    whole.write_rows(ids, rows)
                sync()
                times[mode].append(time.perf_counter() - start)
        assert torch.equal(layered.read_blocks(ids), check.read_blocks(ids)), "layered copy differs from write_rows"
        assert torch.equal(whole.read_blocks(ids), check.read_blocks(ids))
        nbytes = rows.numel()
        best = {mode: min(ts) for mode, ts in times.items()}
        row = {"blocks": n, "bytes": nbytes, **{f"{m}_ms": t * 1e3 for m, t in best.items()},
               **{f"{m}_gb_s": nbytes / t / 1e9 for m, t in best.items()},
               "layered_vs_copy": best["copy"] / best["layered"], "whole_vs_copy": best["copy"] / best["whole"]}
        rows_out.append(row)
        print(f"{n:>6} blocks {nbytes / 2**20:8.1f} MiB  layered {row['layered_gb_s']:7.2f} GB/s  "
              f"copy {row['copy_gb_s']:7.2f}  whole {row['whole_gb_s']:7.2f}  "
              f"layered/copy {row['layered_vs_copy']:.2f}  whole/copy {row['whole_vs_copy']:.2f}", flush=True)
    machine = torch.cuda.get_device_name(0) if cuda else "cpu"
    write_json(args.json, {"machine": machine, "device": args.device, "dtype": args.dtype, "layers": args.layers,
                           "repeats": args.repeats, "rows": rows_out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
