"""The router's view of its workers: which are up, how loaded, and which to pick."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

DOWN_FOR_S = 5.0  # a worker that failed a call is skipped this long, then tried again
TPOT_WEIGHT = 0.3  # of the newest request in a worker's moving average of seconds per output token


@dataclass(slots=True)
class Instance:
    url: str  # http://host:port, no trailing slash
    role: str  # prefill | decode
    outstanding: int = 0  # requests the router has in flight there
    routed: int = 0  # requests routed there since start
    failures: int = 0
    down_until: float = 0.0
    down_reason: str | None = None
    tpot_s: float | None = None  # decode: moving average of seconds per output token the router measured

    def observe_tpot(self, seconds: float) -> None:
        self.tpot_s = seconds if self.tpot_s is None else TPOT_WEIGHT * seconds + (1 - TPOT_WEIGHT) * self.tpot_s

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    def failed(self, why: str) -> None:
        self.failures += 1
        self.down_until = time.monotonic() + DOWN_FOR_S
        self.down_reason = why


@dataclass(slots=True)
class Instances:
    """Prefill and decode workers; picks the least loaded one that is up (ties: the first listed)."""

    prefill: list[Instance] = field(default_factory=list)
    decode: list[Instance] = field(default_factory=list)

    @classmethod
    def of(cls, prefill_urls: list[str], decode_urls: list[str]) -> Instances:
        if not decode_urls:
            raise ValueError("a prefill/decode router needs at least one decode instance")
        return cls([Instance(u.rstrip("/"), "prefill") for u in prefill_urls],
                   [Instance(u.rstrip("/"), "decode") for u in decode_urls])

    def pick(self, role: str, exclude: set[str] | None = None, tpot_target: float | None = None) -> Instance | None:
        """The least loaded live worker; with `tpot_target` (seconds), a decode worker whose measured TPOT meets
        it (or is not measured yet) if any does, else the fastest one."""
        pool = self.prefill if role == "prefill" else self.decode
        live = [i for i in pool if i.up and (not exclude or i.url not in exclude)]
        if not live:
            return None
        if tpot_target is not None:
            meets = [i for i in live if i.tpot_s is None or i.tpot_s <= tpot_target]
            if not meets:
                return min(live, key=lambda i: (i.tpot_s, i.outstanding))
            live = meets
        return min(live, key=lambda i: i.outstanding)

    def all(self) -> list[Instance]:
        return [*self.prefill, *self.decode]
