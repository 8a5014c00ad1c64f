"""`MooncakeTier`: KV blocks in a Mooncake Store, shared by every server that uses the same schema.

Mooncake Store (``pip install 'sage-infer[mooncake]'``, module `mooncake.store`) is a
distributed object store for KV cache: one `mooncake_master` places objects, and each
member process mounts a slice of its DRAM (a *segment*) that holds them; data moves over TCP
or RDMA. This tier is one such member: it mounts ``segment`` bytes and reads and writes
blocks anywhere in the store. See `mooncake_url.py` for the URL.

Keys: ``<prefix><schema digest hex>:<block hash hex>``, as in `RedisTier`, so servers with
the same schema reuse each other's blocks and two schemas never collide. Value: the same
12-byte header then the payload (magic ``b"SKM1"``, payload CRC32C, payload length).

Every call is one batch call (`batch_put_from`, `batch_get_into`, `batch_is_exist`,
`batch_remove`) from a staging buffer registered with the store once; batches bigger than
the buffer go in chunks. Each call runs on one worker thread and is bounded by ``timeout``:
past it, or on an RPC failure, it raises `TierError` (counted in `stats().errors`); while an
abandoned call is still stuck in the store, the next calls fail at once instead of queueing.

Capacity: Mooncake evicts only above its master's high watermark, and in practice a full
segment makes puts fail with NO_AVAILABLE_HANDLE instead. So the tier bounds itself: it
keeps an LRU of the blocks *it* put (touched again on hits) and removes the oldest past
``capacity_bytes // bytes_per_block`` blocks; a put the store still refuses for space is
counted in `dropped`, never raised. Blocks whose lease expired or that the store evicted
or lost (a member left) read as misses. `stats().blocks` counts this server's blocks only.
"""

from __future__ import annotations

import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import numpy as np
import torch

from sage_infer.core.kv_schema import KVCacheSchema
from sage_infer.errors import NotAvailableError
from sage_infer.kv_runtime.tiers.base import VALUE_HEADER, KVTier, pack_value_header, verify_value
from sage_infer.kv_runtime.tiers.mooncake_url import MIN_SEGMENT_BYTES, MooncakeAddress, parse_mooncake_url
from sage_infer.kv_runtime.tiers.tier_errors import TierError

if TYPE_CHECKING:
    from sage_infer.kv_runtime.tiers.mooncake_shares import MooncakeTenantShares

VALUE_MAGIC = b"SKM1"
STAGING_BYTES = 64 << 20  # the registered buffer every call goes through

# mooncake ErrorCode values (mooncake-store/include/types.h)
OBJECT_ALREADY_EXISTS = -705
OBJECT_NOT_FOUND = -704
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600  # a get into a buffer smaller than the stored value
UNREACHABLE = {-1: "INTERNAL_ERROR", -900: "RPC_FAIL", -1010: "UNAVAILABLE_IN_CURRENT_STATUS"}

INSTALL = "pip install 'sage-infer[mooncake]'"


def load_store_class() -> type:
    """`mooncake.store.MooncakeDistributedStore`, or `NotAvailableError` saying what is missing."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] == "mooncake":
            raise NotAvailableError(f"the mooncake tier needs Mooncake Store: {INSTALL}") from None
        raise NotAvailableError(f"the mooncake tier cannot import mooncake.store: {err}") from None
    except ImportError as err:  # the extension is there, a system library is not
        hint = " (apt-get install libibverbs1)" if "ibverbs" in str(err) else ""
        raise NotAvailableError(f"the mooncake tier cannot load mooncake.store: {err}{hint}") from None
    return MooncakeDistributedStore


def route_address(host: str, port: int) -> str:
    """The local address this machine uses to reach host:port (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((host, port))
            return sock.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class _Call:
    """One store call handed to the worker; the caller may abandon it at its deadline."""

    __slots__ = ("abandoned", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.abandoned = False


class MooncakeTier(KVTier):
    """The remote tier over Mooncake Store: a bounded, checksummed block store."""

    shared = True  # other servers read and write it too: loads never delete from it

    def __init__(
        self,
        schema: KVCacheSchema,
        url: str = "mooncake://127.0.0.1:50051",
        capacity_bytes: int = 1 << 30,
        *,
        timeout_s: float | None = None,
        setup_timeout_s: float = 10.0,
        prefix: str = "sage:kv:",
        name: str = "mooncake",
    ) -> None:
        super().__init__(schema, capacity_bytes, name)
        self.address: MooncakeAddress = parse_mooncake_url(url)
        store_class = load_store_class()
        self.timeout_s = self.address.timeout_s if timeout_s is None else float(timeout_s)
        self.max_blocks = self.capacity_bytes // self.bytes_per_block
        self.key_prefix = f"{prefix}{self.digest.hex()}:"
        self.value_bytes = VALUE_HEADER.size + self.bytes_per_block
        if self.address.segment_bytes is None:  # room for the allocator: it fills ~90% of a segment
            self.segment_bytes = max(MIN_SEGMENT_BYTES, self.max_blocks * self.value_bytes * 5 // 4 + (1 << 20))
        else:
            self.segment_bytes = self.address.segment_bytes
        self.local = self.address.local or route_address(self.address.host, self.address.port)
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # blocks this server put, oldest first
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-tier")
        self._pending: Future | None = None  # an abandoned call still running on the worker
        self._closed = False
        self._leaving: threading.Thread | None = None
        self._joined = False  # setup succeeded: there is something to leave (close() on a store never set up crashes)
        self.shares: MooncakeTenantShares | None = None  # tenant quotas counted across the servers sharing it
        rows = max(1, min(STAGING_BYTES // self.value_bytes, max(self.max_blocks, 1)))
        self._staging = np.zeros((rows, self.value_bytes), dtype=np.uint8)
        self.store = store_class()
        try:
            self._reachable(min(setup_timeout_s, 5.0))
            self._call("connect", self._setup, timeout=setup_timeout_s)
        except TierError:
            self.close()
            raise

    # -- plumbing -----------------------------------------------------------------------------

    def _reachable(self, timeout: float) -> None:
        """A TCP connect to the master (and an HTTP metadata server): `setup` itself holds the
        GIL while it retries an absent master for minutes, so it only runs once they answer."""
        targets = [(self.address.host, self.address.port, "mooncake_master")]
        meta = urlsplit(self.address.metadata)
        if meta.scheme in ("http", "https") and meta.hostname:
            targets.append((meta.hostname, meta.port or (443 if meta.scheme == "https" else 80), "metadata server"))
        for host, port, what in targets:
            try:
                socket.create_connection((host, port), timeout=timeout).close()
            except OSError as err:
                with self._lock:
                    self._stats.errors += 1
                raise TierError(f"{self.name} tier at {self.address}: no {what} at {host}:{port}: {err}") from None

    def _setup(self, call: _Call) -> None:
        a = self.address
        rc = self.store.setup(
            self.local, a.metadata, self.segment_bytes, 0, a.protocol, a.device, a.master
        )
        if rc != 0:
            raise TierError(f"{self.name} tier at {a}: setup failed with code {rc} (is mooncake_master running?)")
        self._joined = True
        rc = self.store.register_buffer(self._staging.ctypes.data, self._staging.nbytes)
        if rc != 0:
            raise TierError(f"{self.name} tier at {a}: registering the staging buffer failed with code {rc}")

    def _call(self, what: str, fn: Callable[[_Call], object], timeout: float | None = None) -> object:
        """Run `fn` on the worker within the timeout; any failure is one counted `TierError`."""
        if self._closed:
            raise TierError(f"{self.name} tier at {self.address}: {what} failed: the tier is closed")
        if self._pending is not None and not self._pending.done():
            self._fail(what, "an earlier call is still stuck in the store")
        call = _Call()
        future = self._worker.submit(lambda: None if call.abandoned else fn(call))
        try:
            return future.result(timeout=self.timeout_s if timeout is None else timeout)
        except FutureTimeout:
            with call.lock:
                call.abandoned = True
            self._pending = future
            self._fail(what, f"no answer within {self.timeout_s if timeout is None else timeout:g} s")
        except TierError as err:
            with self._lock:
                self._stats.errors += 1
            raise err from None
        except Exception as err:  # noqa: BLE001 - the binding raises plain RuntimeErrors
            self._fail(what, str(err) or type(err).__name__)

    def _fail(self, what: str, why: str):
        with self._lock:
            self._stats.errors += 1
        raise TierError(f"{self.name} tier at {self.address}: {what} failed: {why}")

    def _check_codes(self, what: str, codes: list[int]) -> None:
        for code in codes:
            if code in UNREACHABLE:
                raise TierError(f"{self.name} tier at {self.address}: {what} failed: {UNREACHABLE[code]} ({code})")

    def store_key(self, key: bytes) -> str:
        """The Mooncake key of a block hash."""
        return self.key_prefix + key.hex()

    def _rows(self, n: int):
        step = self._staging.shape[0]
        for start in range(0, n, step):
            yield start, min(n, start + step)

    # -- the protocol -------------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> None:
        """Store every block in batch calls; evicts this server's oldest blocks past the cap."""
        keys, blocks = self._check_put(keys, blocks)
        with self._lock:
            self._stats.puts += len(keys)
        if not keys:
            return
        unique, rows = self._batch_head(keys, self.max_blocks)
        data = blocks.cpu().numpy()
        base, stride = self._staging.ctypes.data, self.value_bytes

        def write(call: _Call) -> list[int]:
            codes: list[int] = []
            for start, stop in self._rows(len(unique)):
                chunk = unique[start:stop]
                for i, key in enumerate(chunk):
                    payload = data[rows[key]]
                    pack_value_header(self._staging[i], VALUE_MAGIC, payload)
                    self._staging[i, VALUE_HEADER.size :] = payload
                got = self.store.batch_put_from(
                    [self.store_key(k) for k in chunk], [base + i * stride for i in range(len(chunk))],
                    [stride] * len(chunk),
                )
                self._check_codes("put", got)
                codes.extend(got)
            return codes

        codes = self._call("put", write)
        stored = [key for key, code in zip(unique, codes, strict=True) if code in (0, OBJECT_ALREADY_EXISTS)]
        with self._lock:
            self._stats.dropped += len(set(keys)) - len(stored)
            for key in reversed(stored):  # the batch's head is the newest
                self._lru[key] = None
                self._lru.move_to_end(key)
            victims = []
            while len(self._lru) > self.max_blocks:
                victims.append(self._lru.popitem(last=False)[0])
        if victims:
            self._remove("evict", victims)
            with self._lock:
                self._stats.evictions += len(victims)

    def _load(self, keys: list[bytes], out: torch.Tensor, prefix: bool) -> list[bool]:
        out_np = out.numpy()
        base, stride = self._staging.ctypes.data, self.value_bytes

        def read(call: _Call) -> tuple[list[bool], list[bytes]]:
            found = [False] * len(keys)
            bad: list[bytes] = []
            for start, stop in self._rows(len(keys)):
                chunk = keys[start:stop]
                got = self.store.batch_get_into(
                    [self.store_key(k) for k in chunk], [base + i * stride for i in range(len(chunk))],
                    [stride] * len(chunk),
                )
                self._check_codes("get", got)
                with call.lock:
                    if call.abandoned:  # the caller gave up: its `out` is no longer ours to write
                        return found, bad
                    for i, size in enumerate(got):
                        if size == stride and verify_value(self._staging[i], VALUE_MAGIC, self.bytes_per_block):
                            out_np[start + i] = self._staging[i, VALUE_HEADER.size :]
                            found[start + i] = True
                            continue
                        if size > 0 or size == INVALID_PARAMS:  # there, but the wrong size or checksum
                            bad.append(chunk[i])
                        if prefix:
                            return found, bad
            return found, bad

        found, bad = self._call("get", read)
        hits = [key for key, hit in zip(keys, found, strict=True) if hit]
        with self._lock:
            for key in hits:
                if key in self._lru:
                    self._lru.move_to_end(key)
            self._stats.checksum_failures += len(bad)
        if bad:
            self.delete(bad)
        return found


    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = self._check_keys(keys)
        if not keys:
            return []

        def exists(call: _Call) -> list[int]:
            got = self.store.batch_is_exist([self.store_key(k) for k in keys])
            if any(code < 0 for code in got):
                raise TierError(f"{self.name} tier at {self.address}: contains failed: codes {sorted(set(got))}")
            return got

        return [code == 1 for code in self._call("contains", exists)]

    def delete(self, keys: Sequence[bytes]) -> None:
        keys = self._check_keys(keys)
        with self._lock:
            for key in keys:
                self._lru.pop(key, None)
        if keys:
            self._remove("delete", keys)

    def _remove(self, what: str, keys: list[bytes]) -> None:
        def remove(call: _Call) -> None:  # force: skip the read lease (a reader checks the CRC anyway)
            self._check_codes(what, self.store.batch_remove([self.store_key(k) for k in keys], True))

        self._call(what, remove)

    def _refresh_stats(self) -> None:
        """This server's blocks (the store holds others' too); no store call, so it never fails."""
        self._stats.blocks = len(self._lru)
        self._stats.bytes = len(self._lru) * self.bytes_per_block

    def tenant_shares(self, local: Callable[[], dict[bytes, int]]) -> MooncakeTenantShares:
        """The other servers' tenant counts in this shared tier, this server's (`local`) published for them."""
        from sage_infer.kv_runtime.tiers.mooncake_shares import SLOT_BYTES, SLOTS, MooncakeTenantShares

        buffer = np.zeros((SLOTS + 1, SLOT_BYTES), dtype=np.uint8)

        def register(call: _Call) -> None:
            if self.store.register_buffer(buffer.ctypes.data, buffer.nbytes) != 0:
                raise TierError(f"{self.name} tier at {self.address}: registering the tenant shares' buffer failed")
        self._call("register", register)
        self.shares = MooncakeTenantShares(lambda what, fn: self._call(what, lambda _: fn(self.store)), buffer,
                                           self.key_prefix, local, failures=(TierError,))
        return self.shares

    def close(self, wait: bool = False) -> None:
        """Leave the store in the background: Mooncake's close takes ~2 s even when all is well
        (and more when the master is gone); its segment is released when that finishes.
        `wait`: return only then (bounded by 30 s)."""
        if self._closed:
            if wait and self._leaving is not None:
                self._leaving.join(timeout=30)
            return
        if self.shares is not None:
            self.shares.close()
        self._closed = True
        store, staging, worker = self.store, self._staging, self._worker

        def leave() -> None:
            worker.shutdown(wait=True)
            if not self._joined:
                return
            try:
                store.unregister_buffer(staging.ctypes.data)
                store.close()
            except Exception:  # noqa: BLE001, S110 - best effort on the way out
                pass

        self._leaving = threading.Thread(target=leave, name=f"{self.name}-tier-close", daemon=True)
        self._leaving.start()
        if wait:
            self._leaving.join(timeout=30)
