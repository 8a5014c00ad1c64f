"""Replay a Mooncake trace (JSONL: timestamp, input_length, output_length, hash_ids).

Each hash id names one 512-token prompt block, prefix-chained: two requests with the
same id at position k share their whole prompt up to the end of block k. We turn every
id into a fixed run of token ids drawn from ``random.Random(f"mooncake:{seed}:{id}")``,
so requests that share ids really send identical token prefixes and a prefix cache on
the server can reuse exactly what the trace says is reusable.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from sage_infer.errors import UsageError
from sage_infer.serving_bench.workloads import BenchRequest, Workload, random_token_ids

MOONCAKE_BLOCK_TOKENS = 512


def block_tokens(length_scale: float) -> int:
    """Tokens per trace block after scaling; at least one so every block stays distinct."""
    return max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))


def load_mooncake_trace(
    path: Path,
    num_requests: int,
    *,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_input_len: int | None = None,
    vocab_size: int = 512,
    seed: int = 0,
) -> Workload:
    """The first `num_requests` rows of `path` as a workload with the trace's arrival times.

    Arrival = (timestamp - first timestamp) ms x `time_scale`. Prompt lengths scale by
    ``block_tokens(length_scale) / 512`` (the rounded block size, so the scaled prompt
    still covers the same blocks) and are then cut at `max_input_len`; output lengths
    scale by `length_scale`. Every row is one single-turn conversation.
    """
    rows = _read_rows(path, num_requests)
    if not rows:
        raise UsageError(f"--trace-file {path}: no requests in the file")
    tokens_per_block = block_tokens(length_scale)
    blocks: dict[int, list[int]] = {}
    conversations, arrivals = [], []
    t0 = min(row[0] for row in rows)
    for i, (timestamp, input_length, output_length, hash_ids) in enumerate(rows):
        segments = []
        for hash_id in hash_ids:
            if hash_id not in blocks:
                rng = random.Random(f"mooncake:{seed}:{hash_id}")
                blocks[hash_id] = random_token_ids(rng, tokens_per_block, vocab_size)
            segments.append(blocks[hash_id])
        input_len = max(1, round(input_length * tokens_per_block / MOONCAKE_BLOCK_TOKENS))
        if max_input_len is not None:
            input_len = min(input_len, max_input_len)
        output_len = max(1, round(output_length * length_scale))
        conversations.append([BenchRequest(segments, input_len, output_len, conversation=i)])
        arrivals.append((timestamp - t0) / 1000.0 * time_scale)
    info = {"trace_file": str(path), "block_tokens": tokens_per_block, "distinct_blocks": len(blocks)}
    return Workload("trace", conversations, arrivals_s=arrivals, info=info)


def _read_rows(path: Path, limit: int) -> list[tuple[float, int, int, list[int]]]:
    try:
        handle = path.open(encoding="utf-8")
    except OSError as err:
        raise UsageError(f"--trace-file {path}: {err.strerror or err}") from None
    rows: list[tuple[float, int, int, list[int]]] = []
    with handle:
        for number, line in enumerate(handle, 1):
            if len(rows) >= limit:
                break
            if line.strip():
                rows.append(_parse_row(line, f"{path}:{number}"))
    return rows


def _parse_row(line: str, where: str) -> tuple[float, int, int, list[int]]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise UsageError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise UsageError(f"{where}: expected a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in row]
    if missing:
        raise UsageError(f"{where}: missing field(s) {', '.join(missing)}")
    timestamp, input_length, output_length, hash_ids = (
        row["timestamp"], row["input_length"], row["output_length"], row["hash_ids"])
    if not _is_number(timestamp) or timestamp < 0:
        raise UsageError(f"{where}: timestamp must be a non-negative number of ms, got {timestamp!r}")
    for name, value in (("input_length", input_length), ("output_length", output_length)):
        if not _is_int(value) or value < 1:
            raise UsageError(f"{where}: {name} must be a positive integer, got {value!r}")
    if not isinstance(hash_ids, list) or not hash_ids or not all(_is_int(h) for h in hash_ids):
        raise UsageError(f"{where}: hash_ids must be a non-empty list of integers")
    if len(hash_ids) < math.ceil(input_length / MOONCAKE_BLOCK_TOKENS):
        raise UsageError(
            f"{where}: {len(hash_ids)} hash_ids cover {len(hash_ids) * MOONCAKE_BLOCK_TOKENS} tokens "
            f"but input_length is {input_length}")
    return float(timestamp), input_length, output_length, hash_ids


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
