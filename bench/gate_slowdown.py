"""SAGE_GATE_SLOW: a deliberately slowed (or worsened) path, to show that bench/ci_gate.py catches a regression.

    SAGE_GATE_SLOW=engine python bench/ci_gate.py       # every engine step takes twice as long: exit 1
    SAGE_GATE_SLOW=engine:0.3 python bench/ci_gate.py   # 30 % longer

Read by the gate only. It patches classes inside the gate's own process; product code never reads the variable.
  engine   `LLMEngine.step` sleeps F times as long as the step took (F = 1 unless NAME:F)
  tiers    `HostTier` / `DiskTier` put, get_prefix, drain and flush do the same
  prefix   every request gets a cache salt of its own, so no request reuses another's blocks
  evict    the eviction policies are not told which blocks requests hold (`EvictionPolicy.on_use` does nothing), so
           every eviction walks past them again
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable


def _slower(fn: Callable, factor: float) -> Callable:
    """`fn`, followed by a sleep of `factor` times what it took."""
    @functools.wraps(fn)
    def slowed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            time.sleep(factor * (time.perf_counter() - start))
    return slowed


def _no_reuse(add_request: Callable) -> Callable:
    @functools.wraps(add_request)
    def salted(*args, **kwargs):
        kwargs["cache_salt"] = uuid.uuid4().hex  # a salt of its own: no request shares a block with another
        return add_request(*args, **kwargs)
    return salted


def apply_slowdown(spec: str) -> str:
    """Patch this process as SAGE_GATE_SLOW=`spec` asks; what was patched, for the report."""
    name, _, factor_text = spec.partition(":")
    if name not in ("engine", "tiers", "prefix", "evict"):
        raise SystemExit(f"gate: SAGE_GATE_SLOW={spec!r}: expected engine, tiers, prefix or evict (optionally "
                         "NAME:FACTOR)")
    try:
        factor = float(factor_text or 1.0)
    except ValueError:
        raise SystemExit(f"gate: SAGE_GATE_SLOW={spec!r}: the factor after ':' must be a number") from None
    from sage_infer.engine.llm_engine import LLMEngine
    from sage_infer.kv_runtime.tiers import DiskTier, HostTier

    if name == "engine":
        LLMEngine.step = _slower(LLMEngine.step, factor)
        return f"LLMEngine.step + {factor:.0%}"
    if name == "tiers":
        for cls, method in ((HostTier, "put"), (HostTier, "get_prefix"), (HostTier, "drain"), (DiskTier, "put"),
                            (DiskTier, "get_prefix"), (DiskTier, "flush")):
            setattr(cls, method, _slower(getattr(cls, method), factor))
        return f"HostTier/DiskTier put, get_prefix, drain, flush + {factor:.0%}"
    if name == "evict":
        from sage_infer.kv_policy import POLICIES

        for cls in POLICIES.values():
            cls.on_use = lambda self, key: None
        return "EvictionPolicy.on_use: holds not told"
    LLMEngine.add_request = _no_reuse(LLMEngine.add_request)
    return "LLMEngine.add_request: a cache salt per request"
