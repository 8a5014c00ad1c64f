"""KV eviction policies, shared by the runtime and the trace replay simulator."""

from sage_infer.kv_policy.base import POLICIES, EvictionPolicy, make_policy, register_policy
from sage_infer.kv_policy.lru import LRUPolicy

__all__ = ["POLICIES", "EvictionPolicy", "LRUPolicy", "make_policy", "register_policy"]
