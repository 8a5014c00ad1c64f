"""Which features of a block predict that it will be reused? A scan of a Mooncake trace.

    python bench/trace_reuse_features.py ../shared/traces/mooncake/conversation_trace.jsonl \
        --json out/reuse_features.json

For every block at its first appearance: is it reused later in the trace (infinite
cache)? Grouped by: chain tail (last block of its request), conversation turn (1 = the
request only reused a root block, +1 per continued turn), position in the prompt
(quarters), prompt length in blocks (buckets of 8) and output length (buckets of 200).
Prints blocks and reuse probability per group and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def scan(path: Path) -> dict[str, dict[str, list[int]]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    uses: dict[int, int] = defaultdict(int)
    for row in rows:
        for h in row["hash_ids"]:
            uses[h] += 1
    seen: set[int] = set()
    turn_of: dict[int, int] = {}
    stats: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for row in rows:
        ids = row["hash_ids"]
        n = len(ids)
        hit = 0
        while hit < n and ids[hit] in seen:
            hit += 1
        turn = (turn_of.get(ids[hit - 1], 0) + 1 if hit > 1 else 1) if hit else 0
        for k, h in enumerate(ids):
            if h in seen:
                continue
            seen.add(h)
            turn_of[h] = turn
            reused = uses[h] > 1
            features = (("tail", k == n - 1), ("turn", min(turn, 6)), ("prompt_quarter", 4 * k // n),
                        ("prompt_blocks/8", min(n, 64) // 8), ("output/200", min(row["output_length"] // 200, 5)))
            for feature, value in features:
                cell = stats[feature][str(value)]
                cell[0] += 1
                cell[1] += reused
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    stats = scan(args.trace)
    out = {}
    for feature, groups in stats.items():
        out[feature] = {}
        for value, (blocks, reused) in sorted(groups.items()):
            out[feature][value] = {"blocks": blocks, "reuse_probability": reused / blocks}
            print(f"{feature:>16} {value:>6} {blocks:>8} blocks  reuse {reused / blocks:6.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
