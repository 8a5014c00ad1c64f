"""Where the remote tier's Redis is: ``redis://``, ``rediss://`` (TLS) and ``unix://`` URLs.

    redis://[user:password@]host[:port][/db]      port 6379, db 0 by default
    rediss://...                                   the same over TLS
    unix://[user:password@]/path/to/redis.sock[?db=N]
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

from sage_infer.kv_runtime.tiers.tier_errors import TierConfigError

DEFAULT_PORT = 6379


@dataclass(frozen=True, slots=True)
class RedisAddress:
    scheme: str  # "redis" | "rediss" | "unix"
    host: str | None = None
    port: int | None = None
    path: str | None = None  # unix socket
    db: int = 0
    username: str | None = None
    password: str | None = None

    def connection_kwargs(self) -> dict:
        """Keyword arguments for `redis.Redis(...)`."""
        kwargs: dict = {"db": self.db, "username": self.username, "password": self.password}
        if self.scheme == "unix":
            kwargs["unix_socket_path"] = self.path
        else:
            kwargs.update(host=self.host, port=self.port, ssl=self.scheme == "rediss")
        return kwargs

    def __str__(self) -> str:  # never shows the password
        where = self.path if self.scheme == "unix" else f"{self.host}:{self.port}"
        return f"{self.scheme}://{where}/{self.db}"


def parse_redis_url(url: str) -> RedisAddress:
    """Parse a Redis URL; a malformed one raises `TierConfigError` naming what is wrong."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "unix"):
        raise TierConfigError(f"redis URL {url!r}: scheme must be redis://, rediss:// or unix://")
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    query = parse_qs(parts.query)
    if scheme == "unix":
        if not parts.path:
            raise TierConfigError(f"redis URL {url!r}: unix:// needs a socket path, e.g. unix:///run/redis.sock")
        db = _db(url, query.get("db", ["0"])[0])
        return RedisAddress("unix", path=unquote(parts.path), db=db, username=username, password=password)
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise TierConfigError(f"redis URL {url!r}: the port must be a number from 1 to 65535") from None
    if not parts.hostname:
        raise TierConfigError(f"redis URL {url!r}: no host, e.g. redis://127.0.0.1:6379/0")
    db_text = parts.path.lstrip("/") or query.get("db", ["0"])[0]
    return RedisAddress(
        scheme, host=parts.hostname, port=port, db=_db(url, db_text), username=username, password=password
    )


def _db(url: str, text: str) -> int:
    if not text.isdigit():
        raise TierConfigError(f"redis URL {url!r}: the database must be a number (redis://host:port/0), got {text!r}")
    return int(text)
