"""The router's admission: how many requests run at the decode workers, and who goes next."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass

from sage_infer.config.serve import RouterConfig
from sage_infer.server.openai_errors import APIError


@dataclass(frozen=True, slots=True)
class Slo:
    """When a request reached the router, and its TTFT and TPOT targets in seconds (None: not applied)."""

    arrival: float
    ttft_s: float | None = None
    tpot_s: float | None = None


class Admission:
    """At most `max_outstanding_per_worker` requests in flight per decode worker; the rest wait here, served in
    the strategy's order: fifo (arrival), priority (the request's ``priority``, lower first, then arrival), slo
    (earliest TTFT deadline first: arrival + the request's ``slo_ttft_ms``, or the configured default; its
    ``slo_tpot_ms`` picks the decode worker, see `tpot_target`)."""

    def __init__(self, config: RouterConfig, num_decode: int) -> None:
        self.config = config
        self.limit = config.max_outstanding_per_worker * num_decode
        self.in_flight = 0
        self.waiting: list[tuple[tuple, int, asyncio.Future]] = []
        self._order = itertools.count()

    def key(self, body: dict, arrival: float) -> tuple:
        if self.config.strategy == "priority":
            priority = body.get("priority", 0)
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise APIError(400, "priority must be an integer", "priority")
            return (priority, arrival)
        if self.config.strategy == "slo":
            return (arrival + self.slo(body, arrival).ttft_s, arrival)
        return (arrival,)

    def slo(self, body: dict, arrival: float) -> Slo:
        """The request's targets under strategy slo (none under the others); a bad one is a 400."""
        if self.config.strategy != "slo":
            return Slo(arrival)
        return Slo(arrival, _target_s(body, "slo_ttft_ms", self.config.default_slo_ttft_ms),
                   _target_s(body, "slo_tpot_ms", self.config.default_slo_tpot_ms))

    async def enter(self, body: dict, arrival: float | None = None) -> None:
        key = self.key(body, time.monotonic() if arrival is None else arrival)
        if self.in_flight < self.limit and not self.waiting:
            self.in_flight += 1
            return
        turn = asyncio.get_running_loop().create_future()
        heapq.heappush(self.waiting, (key, next(self._order), turn))
        await turn  # cancelled (client gone): `leave` skips it

    def leave(self) -> None:
        self.in_flight -= 1
        while self.waiting and self.in_flight < self.limit:
            _, _, turn = heapq.heappop(self.waiting)
            if not turn.done():
                self.in_flight += 1
                turn.set_result(None)


def _target_s(body: dict, field: str, default_ms: float) -> float:
    target = body.get(field, default_ms)
    if not isinstance(target, int | float) or isinstance(target, bool) or target <= 0:
        raise APIError(400, f"{field} must be a positive number of milliseconds", field)
    return target / 1000.0
