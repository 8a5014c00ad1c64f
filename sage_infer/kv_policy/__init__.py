"""KV eviction policies, shared by the runtime and the trace replay simulator.

Importing this package registers every built-in policy: lru, lfu, arc, s3fifo, cost, sage, and
opt (Belady's OPT, replay only: it needs the trace's future, see `kv_policy.opt`).
"""

from sage_infer.kv_policy.arc import ARCPolicy
from sage_infer.kv_policy.base import POLICIES, EvictionPolicy, make_policy, register_policy
from sage_infer.kv_policy.cost import CostModel, CostPolicy
from sage_infer.kv_policy.lfu import LFUPolicy
from sage_infer.kv_policy.lru import LRUPolicy
from sage_infer.kv_policy.opt import FutureIndex, OPTPolicy
from sage_infer.kv_policy.s3fifo import S3FIFOPolicy
from sage_infer.kv_policy.sage import SagePolicy

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "CostModel",
    "CostPolicy",
    "EvictionPolicy",
    "FutureIndex",
    "LFUPolicy",
    "LRUPolicy",
    "OPTPolicy",
    "S3FIFOPolicy",
    "SagePolicy",
    "make_policy",
    "register_policy",
]
