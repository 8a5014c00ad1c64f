"""The router's admission: how many requests run at the decode workers, and who goes next."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time

from sage_infer.config.serve import RouterConfig
from sage_infer.server.errors import APIError


class Admission:
    """At most `max_outstanding_per_worker` requests in flight per decode worker; the rest wait here, served in
    the strategy's order: fifo (arrival), priority (the request's ``priority``, lower first, then arrival), slo
    (earliest TTFT deadline first: arrival + the request's ``slo_ttft_ms``, or the configured default)."""

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
            target = body.get("slo_ttft_ms", self.config.default_slo_ttft_ms)
            if not isinstance(target, int | float) or isinstance(target, bool) or target <= 0:
                raise APIError(400, "slo_ttft_ms must be a positive number of milliseconds", "slo_ttft_ms")
            return (arrival + target / 1000.0, arrival)
        return (arrival,)

    async def enter(self, body: dict) -> None:
        key = self.key(body, time.monotonic())
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
