"""Trace replay above the runtime: the simulator drives the production `KVCacheManager`,
index and eviction policies, so what `sage kv replay` measures is what serving does.
"""
