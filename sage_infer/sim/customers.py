"""A synthetic trace of customers sharing long contexts: the fleet bench's workload, for the fleet replay.

C customers, each with a context of its own (a system prompt, documents) that all its requests
share, and a short query of one block per request; Poisson arrivals; customer k drawn with weight
1 / (k + 1)^zipf (0: uniform). In trace blocks (`TRACE_BLOCK_TOKENS` tokens each), so
`sim.fleet.replay_fleet` runs it as it runs the Mooncake traces: the same routing code, with no
machine in the loop — its numbers do not move with the load of the machine that computes them.
"""

from __future__ import annotations

import random

from sage_infer.sim.replay import TraceRequest
from sage_infer.sim.tiered import TRACE_BLOCK_TOKENS

QUERY_ID_BASE = 1 << 40  # query blocks are numbered from here, apart from every context's


def customers_trace(customers: int, context_blocks: int, rate: float, duration_s: float, zipf: float = 0.0,
                    seed: int = 0, output_len: int = 16) -> list[TraceRequest]:
    """`rate` requests per second for `duration_s`, each a customer's context then one query block of its own."""
    if customers < 1 or context_blocks < 1 or rate <= 0 or duration_s <= 0:
        raise ValueError("customers, context_blocks, rate and duration_s must be positive")
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf for k in range(customers)]
    contexts = [[c * context_blocks + b for b in range(context_blocks)] for c in range(customers)]
    requests, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return requests
        customer = rng.choices(range(customers), weights)[0]
        hash_ids = contexts[customer] + [QUERY_ID_BASE + len(requests)]
        requests.append(TraceRequest(int(t * 1000), len(hash_ids) * TRACE_BLOCK_TOKENS, output_len, hash_ids))
