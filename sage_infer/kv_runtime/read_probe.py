"""`probe_reads`: measure each lower tier's read speed when the engine starts, before a request needs it.

Load-or-compute (`kv_policy.load_or_compute`) loads every tier hit until it knows a tier's read rate; a tier slower
than the model computes (a remote store over a busy link) would make the first hits late. Here each store gets a
few probe blocks under keys of their own, reads them back twice (the second read, past first-touch costs, is what
counts), and deletes them. A store is given at most half its free room (a persistent tier restarted full is not
probed: a put there could evict a block someone wants; its rate is learned from its first real read instead). The
probe's gets and puts show in the store's own counters.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time

import torch

from sage_infer.kv_policy.load_or_compute import MIN_READ_BYTES
from sage_infer.kv_runtime.hierarchy import HierarchyManager
from sage_infer.kv_runtime.tiers.tier_errors import TierError

log = logging.getLogger("sage_infer.kv_runtime")
PROBE_BYTES = 2 << 20  # read per store: large enough that per-call costs do not dominate, small enough to be quick
MAX_PROBE_BLOCKS = 256


def probe_reads(hierarchy: HierarchyManager, nbytes: int = PROBE_BYTES) -> dict[str, float]:
    """Write, read back and delete probe blocks in every store with room for them; their read rates go into
    `hierarchy.rates`. Returns bytes per second by store name (the stores probed)."""
    if hierarchy.rates is None:
        return {}
    block_nbytes = hierarchy.pool.block_nbytes
    wanted = max(1, min(MAX_PROBE_BLOCKS, nbytes // block_nbytes))
    measured = {}
    for level, store in enumerate(hierarchy.stores, 1):
        # at most half the room left (a store's own layout may need more than the bytes), and enough to count
        count = min(wanted, (store.capacity_bytes - store.stats().bytes) // (2 * block_nbytes))
        if count * block_nbytes < MIN_READ_BYTES:
            continue
        rows = torch.randint(0, 256, (count, block_nbytes), dtype=torch.uint8)
        out = torch.empty_like(rows)
        salt = os.urandom(16)
        keys = [hashlib.sha256(b"sage-read-probe" + salt + i.to_bytes(4, "little")).digest() for i in range(count)]
        try:
            store.put(keys, rows)
            store.flush()
            seconds = []
            for _ in range(2):
                began = time.perf_counter()
                got = store.get_prefix(keys, out=out)
                seconds.append(time.perf_counter() - began)
            store.delete(keys)
        except TierError as err:
            log.warning("KV tier %s: its read speed could not be measured at start (%s)", store.name, err)
            continue
        if got.shape[0] == count:
            hierarchy.rates.observe_read(level, count * block_nbytes, seconds[-1])
            measured[store.name] = count * block_nbytes / seconds[-1]
    return measured
