"""Belady's OPT over a trace: the upper bound every online policy is measured against.

The policy itself (`kv_policy.opt.OPTPolicy`) only needs a `FutureIndex`; building that
index needs the trace and the replay's block keys, so it lives here, above the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence

from sage_infer.kv_policy.opt import FutureIndex, OPTPolicy
from sage_infer.prefix_reuse.hashing import hash_block
from sage_infer.sim.replay import EXTRA_KEY, ReplayResult, TraceRequest, replay


def future_of(requests: Sequence[TraceRequest]) -> FutureIndex:
    """Hash every request's chain as the replay does: `hash_block(parent, (hash_id,), EXTRA_KEY)`."""
    uses: dict[bytes, list[int]] = {}
    for i, request in enumerate(requests):
        parent = None
        for hash_id in request.hash_ids:
            parent = hash_block(parent, (hash_id,), EXTRA_KEY)
            seen = uses.setdefault(parent, [])
            if not seen or seen[-1] != i:
                seen.append(i)
    return FutureIndex(uses)


def replay_opt(requests: Sequence[TraceRequest], capacity_blocks: int) -> ReplayResult:
    """Replay `requests` under Belady's OPT: the best hit rate any policy reaches at this capacity."""
    return replay(requests, OPTPolicy(future_of(requests)), capacity_blocks)
