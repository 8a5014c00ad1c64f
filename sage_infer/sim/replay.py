"""Trace replay through the production cache code: the engine's `KVCacheManager` (match ->
admit -> commit -> free) over `PrefixReuseIndex` + `BlockManager` + an `EvictionPolicy`.

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

from sage_infer.core.sampling_params import SamplingParams
from sage_infer.core.sequence import Sequence as EngineSequence
from sage_infer.errors import UsageError
from sage_infer.kv_policy.base import EvictionPolicy, make_policy
from sage_infer.kv_runtime.block_manager import BlockManager
from sage_infer.kv_runtime.kv_cache_manager import KVCacheManager
from sage_infer.prefix_reuse.hashing import hash_block
from sage_infer.prefix_reuse.index import PrefixMatch, PrefixReuseIndex


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
_PARAMS = SamplingParams(max_tokens=1)


class TraceCache:
    """One device cache of `capacity_blocks` one-token blocks, driven like the engine drives its pool.

    `clock` is the trace's time, so time-aware policies see request timestamps.
    """

    def __init__(self, policy: EvictionPolicy, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity must be at least one block, got {capacity_blocks}")
        self.policy = policy
        self.index = PrefixReuseIndex(block_size=1, policy=policy)
        self.now = 0.0
        self.kv = KVCacheManager(BlockManager(capacity_blocks, 1, self.index), clock=lambda: self.now)

    def begin(self, i: int, request: TraceRequest) -> tuple[EngineSequence, PrefixMatch]:
        """Stamp the clock and look the request up (nothing recorded yet)."""
        if hasattr(self.policy, "begin_request"):  # OPT reads the request index
            self.policy.begin_request(i)
        self.now = request.timestamp_ms / 1000.0
        seq = EngineSequence(i, str(i), 0, request.hash_ids, len(request.hash_ids), _PARAMS, EXTRA_KEY)
        return seq, self.kv.match(seq, keep_last_token=False)

    def blocks_present(self, seq: EngineSequence, match: PrefixMatch) -> int:
        """Blocks of the request cached when looked up one by one (past the first miss too)."""
        present = hit = len(match.block_ids)
        chain = match.block_hashes[-1] if hit else None
        for token in seq.token_ids[hit:]:
            chain = hash_block(chain, (token,), EXTRA_KEY)
            present += self.index.block_of(chain) is not None
        return present

    def admit_and_compute(self, seq: EngineSequence, match: PrefixMatch) -> None:
        """Admit the request and register every block it computed: a request longer than the cache keeps its head."""
        num_new = min(seq.num_tokens - match.num_tokens, self.kv.available_after(match))
        admitted = self.kv.admit(seq, match, num_new)
        assert admitted, "available_after promised room"
        seq.num_computed_tokens += num_new
        self.kv.commit(seq)


def replay(
    requests: Sequence[TraceRequest],
    policy: str | EvictionPolicy,
    capacity_blocks: int,
    *,
    keep_per_request: bool = False,
) -> ReplayResult:
    """Run every request through the engine's admission path: match -> admit (evicting) -> commit -> free."""
    policy = make_policy(policy, capacity=capacity_blocks) if isinstance(policy, str) else policy
    cache = TraceCache(policy, capacity_blocks)
    result = ReplayResult(policy.name, capacity_blocks)
    start = time.perf_counter()
    for i, request in enumerate(requests):
        seq, match = cache.begin(i, request)
        present = cache.blocks_present(seq, match)
        cache.admit_and_compute(seq, match)
        cache.kv.free(seq)
        hit = len(match.block_ids)
        result.requests += 1
        result.accesses += seq.num_tokens
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
