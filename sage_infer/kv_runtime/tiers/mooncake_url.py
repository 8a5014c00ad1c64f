"""Where the Mooncake Store tier's master is, and how this process joins the store.

    mooncake://HOST:PORT[?metadata=P2PHANDSHAKE|http://H:P/metadata][&protocol=tcp|rdma]
                        [&device=mlx5_0][&segment=SIZE][&local=ADDR][&timeout=SECONDS]

- ``HOST:PORT`` the `mooncake_master` RPC address (port 50051 by default).
- ``metadata`` the transfer engine's metadata service: ``P2PHANDSHAKE`` (the default: no
  service, peers exchange it directly) or the URL of an HTTP metadata server, e.g. the one
  the master runs with ``--enable_http_metadata_server``.
- ``protocol`` ``tcp`` (the default) or ``rdma``; ``device`` names the RDMA NIC(s).
- ``segment`` bytes of this process's DRAM mounted into the store (at least 16MiB, or 0 to
  mount none and use memory of dedicated store servers); by default the tier's capacity
  plus room for Mooncake's allocator.
- ``local`` the address other store members reach this process at; by default the local
  address of the route to the master (127.0.0.1 for a loopback master).
- ``timeout`` seconds one store call may take before it raises `TierError` (default 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from sage_infer.kv_runtime.tiers.tier_errors import TierConfigError

DEFAULT_PORT = 50051
MIN_SEGMENT_BYTES = 16 << 20  # mooncake refuses smaller segments ("Total size must be at least 16777216")
OPTIONS = ("metadata", "protocol", "device", "segment", "local", "timeout")


@dataclass(frozen=True, slots=True)
class MooncakeAddress:
    host: str
    port: int = DEFAULT_PORT
    metadata: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device: str = ""
    segment_bytes: int | None = None  # None: sized from the tier's capacity
    local: str | None = None  # None: the local address of the route to the master
    timeout_s: float = 1.0

    @property
    def master(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"mooncake://{self.master}"


def parse_mooncake_url(url: str) -> MooncakeAddress:
    """Parse a ``mooncake://`` URL; a malformed one raises `TierConfigError` naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "mooncake":
        raise TierConfigError(f"mooncake URL {url!r}: scheme must be mooncake://")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise TierConfigError(f"mooncake URL {url!r}: the port must be a number from 1 to 65535") from None
    if not parts.hostname:
        raise TierConfigError(f"mooncake URL {url!r}: no master host, e.g. mooncake://127.0.0.1:50051")
    if parts.path not in ("", "/"):
        raise TierConfigError(f"mooncake URL {url!r}: no path expected after the master address, got {parts.path!r}")
    try:
        query = parse_qs(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise TierConfigError(f"mooncake URL {url!r}: the query must be key=value pairs joined by &") from None
    unknown = sorted(set(query) - set(OPTIONS))
    if unknown:
        expected = ", ".join(OPTIONS)
        raise TierConfigError(f"mooncake URL {url!r}: unknown option {unknown[0]!r}; expected one of {expected}")
    one = {key: unquote(values[-1]) for key, values in query.items()}
    protocol = one.get("protocol", "tcp").lower()
    if protocol not in ("tcp", "rdma"):
        raise TierConfigError(f"mooncake URL {url!r}: protocol must be tcp or rdma, got {protocol!r}")
    metadata = one.get("metadata", "P2PHANDSHAKE")
    if metadata.upper() == "P2PHANDSHAKE":
        metadata = "P2PHANDSHAKE"
    elif not metadata.startswith(("http://", "https://", "etcd://", "redis://")):
        raise TierConfigError(
            f"mooncake URL {url!r}: metadata must be P2PHANDSHAKE or a metadata server URL "
            f"(http://host:port/metadata), got {metadata!r}"
        )
    segment = None
    if "segment" in one:
        segment = _bytes(url, one["segment"])
        if 0 < segment < MIN_SEGMENT_BYTES:
            raise TierConfigError(f"mooncake URL {url!r}: segment must be 0 or at least 16MiB, got {segment} B")
    timeout = 1.0
    if "timeout" in one:
        try:
            timeout = float(one["timeout"])
        except ValueError:
            timeout = -1.0
        if not 0 < timeout <= 600:
            raise TierConfigError(f"mooncake URL {url!r}: timeout must be seconds in (0, 600], got {one['timeout']!r}")
    return MooncakeAddress(
        host=parts.hostname,
        port=port,
        metadata=metadata,
        protocol=protocol,
        device=one.get("device", ""),
        segment_bytes=segment,
        local=one.get("local") or None,
        timeout_s=timeout,
    )


def _bytes(url: str, text: str) -> int:
    from pydantic import ByteSize, TypeAdapter, ValidationError

    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise TierConfigError(f"mooncake URL {url!r}: segment must be a size such as 64MiB, got {text!r}") from None
