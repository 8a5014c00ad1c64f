"""Tenant shares of a Mooncake Store tier that several servers share (`MooncakeTier.tenant_shares`).

Mooncake Store has no key listing and no expiry, so the servers sharing a tier meet in a fixed
set of `SLOTS` small objects, ``<tier prefix>tenants:<k>``: a server claims the first free slot
with a put (which fails on a slot another server holds), then rewrites it at each exchange
(`upsert`) with its tenants' counts and a sequence number that grows by one each time. One
exchange reads every slot in one call. A slot whose sequence has not moved for `TTL_S` of
this server's clock belongs to a server that stopped: it is left out of the sum and removed,
freeing it. A server that finds its slot gone (removed so, or evicted by the store) claims
one again at its next exchange. Values move through a buffer registered with the store (the
tier's members mount no client buffer for plain puts); a slot holds at most `SLOT_BYTES`, so a
server publishes its largest tenants' counts up to that (about 300 tenants).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

import numpy as np

from sage_infer.kv_runtime.tiers.mooncake import OBJECT_ALREADY_EXISTS, OBJECT_NOT_FOUND
from sage_infer.kv_runtime.tiers.tenant_shares import REFRESH_S, TTL_S, TenantShares, summed
from sage_infer.kv_runtime.tiers.tier_errors import TierError

SLOTS = 64  # servers that can share one tier's quotas
SLOT_BYTES = 16 << 10  # of one server's published counts


class MooncakeTenantShares(TenantShares):
    """The blocks each tenant holds in a shared Mooncake Store tier through the other servers (`others`). `call(what,
    fn)` runs `fn(store)` as the tier runs its store calls (one worker, bounded by its timeout, TierError on
    failure)."""

    store = "Mooncake Store"

    def __init__(self, call: Callable, buffer: np.ndarray, key_prefix: str, local: Callable[[], dict[bytes, int]],
                 refresh_s: float = REFRESH_S, ttl_s: float = TTL_S, clock: Callable[[], float] = time.monotonic,
                 failures: tuple[type[BaseException], ...] = (Exception,)) -> None:
        super().__init__(local, refresh_s, clock, failures)
        self.call, self.ttl_s = call, ttl_s
        self.buffer = buffer  # (SLOTS + 1, SLOT_BYTES) uint8, registered with the store: a row per slot, one to write
        self.keys = [f"{key_prefix}tenants:{k}" for k in range(SLOTS)]
        self.server = uuid.uuid4().hex
        self.slot: int | None = None
        self.seq = 0
        self.heard: dict[int, tuple[str, int, float]] = {}  # slot -> (server, seq, when that seq was first read)

    def exchange(self, own: dict[str, int]) -> dict[str, int]:
        values = self.call("tenant shares", self._read)
        now, tables, stale = self.clock(), [], []
        for slot, value in enumerate(values):
            entry = _decode(value)
            if entry is None:
                continue
            server, seq, counts = entry
            if server == self.server:
                continue
            last = self.heard.get(slot)
            if last is None or last[:2] != (server, seq):
                self.heard[slot] = (server, seq, now)
            elif now - last[2] >= self.ttl_s:
                stale.append(slot)
                continue
            tables.append(counts)
        if stale:
            self.call("tenant shares", lambda store: [store.remove(self.keys[slot], True) for slot in stale])
        self._publish(own, values)
        return summed(tables)

    def _read(self, store) -> list[bytes]:
        """Every slot's value (b"" where none is stored)."""
        base = self.buffer.ctypes.data
        got = store.batch_get_into(self.keys, [base + k * SLOT_BYTES for k in range(SLOTS)], [SLOT_BYTES] * SLOTS)
        failed = next((code for code in got if code < 0 and code != OBJECT_NOT_FOUND), None)
        if failed is not None:  # unreachable, or a value bigger than a slot: keep the last counts
            raise TierError(f"reading the tenant shares failed with code {failed}")
        return [self.buffer[k, :n].tobytes() if n > 0 else b"" for k, n in enumerate(got)]

    def _write(self, payload: bytes, put: bool):
        """What writes `payload` to a slot: ``put`` (claim: fails where the slot is taken) or ``upsert``."""
        row = self.buffer[SLOTS]
        row[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        address = row.ctypes.data
        if put:
            return lambda store, key: store.put_from(key, address, len(payload))
        return lambda store, key: store.upsert_from(key, address, len(payload))

    def _publish(self, own: dict[str, int], values: list[bytes]) -> None:
        """Rewrite this server's slot, or claim a free one when it has none (or lost it)."""
        self.seq += 1
        payload = _encode(self.server, self.seq, own)
        if self.slot is not None and (_decode(values[self.slot]) or ("",))[0] == self.server:
            write, key = self._write(payload, put=False), self.keys[self.slot]
            self.call("tenant shares", lambda store: write(store, key))
            return
        self.slot = None
        write = self._write(payload, put=True)
        for slot, value in enumerate(values):
            if value:
                continue
            code = self.call("tenant shares", lambda store, key=self.keys[slot]: write(store, key))
            if code == 0:
                self.slot = slot
                return
            if code != OBJECT_ALREADY_EXISTS:
                return  # the store refused for another reason (full): try again at the next exchange

    def leave(self) -> None:
        if self.slot is not None:
            self.call("tenant shares", lambda store: store.remove(self.keys[self.slot], True))
            self.slot = None


def _encode(server: str, seq: int, own: dict[str, int]) -> bytes:
    """A slot's value: this server's counts, its largest tenants' first when they do not all fit."""
    counts = dict(sorted(own.items(), key=lambda item: -item[1]))
    while True:
        payload = json.dumps({"server": server, "seq": seq, "counts": counts}, separators=(",", ":")).encode()
        if len(payload) <= SLOT_BYTES:
            return payload
        counts = dict(list(counts.items())[:len(counts) * 3 // 4])


def _decode(value: bytes) -> tuple[str, int, dict[str, int]] | None:
    """(server, seq, counts) of a slot's object; None for an empty slot or one not written by this code."""
    if not value:
        return None
    try:
        entry = json.loads(value)
        return str(entry["server"]), int(entry["seq"]), {str(k): int(n) for k, n in entry["counts"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
