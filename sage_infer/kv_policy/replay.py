"""Trace replay through the production cache code: `PrefixReuseIndex` + `BlockManager` +
an `EvictionPolicy`, exactly as the engine drives them.

A trace block (512 tokens in Mooncake traces) is replayed as a one-token block whose token
id is the trace's hash id: hash ids are already prefix-chained, so chaining them again
keeps the same identity, and the index's leaf-only eviction applies unchanged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sage_infer.errors import UsageError
from sage_infer.kv_policy.base import EvictionPolicy, make_policy
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.prefix_reuse.hashing import hash_block
from sage_infer.prefix_reuse.index import PrefixReuseIndex


@dataclass(slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def load_mooncake(path: str | Path) -> list[TraceRequest]:
    """Mooncake JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UsageError(f"{path}: trace file not found") from None
    except OSError as err:
        raise UsageError(f"{path}: cannot read: {err.strerror}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            hash_ids = [int(h) for h in row["hash_ids"]]
            requests.append(TraceRequest(int(row["timestamp"]), int(row["input_length"]),
                                         int(row.get("output_length", 0)), hash_ids))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise UsageError(f"{path}:{number}: malformed trace line ({type(err).__name__}: {err}); expected "
                             "JSON with timestamp, input_length, output_length, hash_ids") from None
    if not requests:
        raise UsageError(f"{path}: the trace has no requests")
    return requests


@dataclass(slots=True)
class ReplayResult:
    policy: str
    capacity_blocks: int
    requests: int = 0
    accesses: int = 0
    block_hits: int = 0  # blocks present when looked up one by one
    prefix_hits: int = 0  # blocks in each request's longest cached leading run
    seconds: float = 0.0
    per_request_prefix_hits: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.block_hits / self.accesses if self.accesses else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.accesses if self.accesses else 0.0

    @property
    def us_per_access(self) -> float:
        return self.seconds / self.accesses * 1e6 if self.accesses else 0.0


EXTRA_KEY = b"replay"


def replay(
    requests: Sequence[TraceRequest],
    policy: str | EvictionPolicy,
    capacity_blocks: int,
    *,
    keep_per_request: bool = False,
) -> ReplayResult:
    """Run every request through match -> acquire -> allocate (evicting) -> register -> free."""
    if capacity_blocks <= 0:
        raise ValueError(f"capacity must be at least one block, got {capacity_blocks}")
    policy = make_policy(policy, capacity=capacity_blocks) if isinstance(policy, str) else policy
    index = PrefixReuseIndex(block_size=1, policy=policy)
    manager = BlockManager(capacity_blocks, 1, index)
    result = ReplayResult(policy.name, capacity_blocks)
    start = time.perf_counter()
    for i, request in enumerate(requests):
        if hasattr(policy, "begin_request"):
            policy.begin_request(i)
        ids = request.hash_ids
        policy.tick(request.timestamp_ms / 1000.0)
        match = index.match(ids, EXTRA_KEY)
        hit = len(match.block_ids)
        present = hit
        parent = match.block_hashes[-1] if hit else None
        # blocks after the first miss may still be cached (block-level counting)
        chain = parent
        for token in ids[hit:]:
            chain = hash_block(chain, (token,), EXTRA_KEY)
            present += index.block_of(chain) is not None
        manager.acquire(match.block_ids)
        table = list(match.block_ids)
        hashes = list(match.block_hashes)
        wanted = min(len(ids) - hit, manager.num_available_blocks)  # a request longer than the cache keeps its head
        if wanted > 0:
            table.extend(manager.allocate(wanted))
        for k in range(hit, len(table)):
            block_id, block_hash = manager.cache_block(table[k], hashes[-1] if hashes else None, (ids[k],), EXTRA_KEY)
            table[k] = block_id
            hashes.append(block_hash)
        manager.free(list(reversed(table)))
        result.requests += 1
        result.accesses += len(ids)
        result.block_hits += present
        result.prefix_hits += hit
        if keep_per_request:
            result.per_request_prefix_hits.append(hit)
    result.seconds = time.perf_counter() - start
    return result


def distinct_blocks(requests: Sequence[TraceRequest]) -> int:
    return len({h for r in requests for h in r.hash_ids})


def ideal_hit_rate(requests: Sequence[TraceRequest]) -> float:
    """Infinite cache: every access after a block's first is a hit."""
    total = sum(len(r.hash_ids) for r in requests)
    return 1.0 - distinct_blocks(requests) / total if total else 0.0
