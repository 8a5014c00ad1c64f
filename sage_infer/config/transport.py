"""`KVTransportConfig`: how KV blocks move between instances, tiers and hosts.

Set from a transport preset (``presets/transport/*.yaml``), a ``--config`` file,
``SAGE_KV_TRANSPORT__*`` env vars, or ``--kv-transport key=value`` flags.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import ByteSize, Field, SecretStr, field_validator

from sage_infer.config.hardware import Strict

TransportBackend = Literal["auto", "shm", "tcp", "torchdist", "rdma"]
TransportDtype = Literal["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "int8", "int4"]

MIN_CHUNK = 4 * 1024
MAX_CHUNK = 1024 * 1024 * 1024
MIN_TOKEN = 16


class ProcessGroupConfig(Strict):
    """The torch.distributed process group a prefill/decode worker joins for ``backend: torchdist``.

    Every worker of the deployment joins the same group (gloo for a KV pool on the CPU, the device's
    backend, e.g. nccl, for one on an accelerator); a decode worker's KV address is its rank.
    `sage llm serve --pd xPyD` fills in `init_method`, `rank` and `world_size` itself. A process that
    already has a group (started by torchrun, say) uses it when these are unset.
    """

    init_method: str | None = Field(None, description="Where the ranks meet: tcp://HOST:PORT (rank 0 listens "
                                    "there, the others dial it) or file:///PATH on a shared filesystem. --pd: "
                                    "a free 127.0.0.1 port unless set.")
    rank: int | None = Field(None, ge=0, description="This worker's rank, 0..world_size-1 (--pd assigns them: "
                             "prefill workers first, then decode).")
    world_size: int | None = Field(None, ge=2, le=65536, description="Workers in the group (--pd: x + y).")
    timeout_s: float = Field(120.0, gt=0, le=3600, description="How long joining waits for every rank to "
                             "arrive; past it the worker stops with an error instead of hanging.")

    @field_validator("init_method")
    @classmethod
    def _rendezvous_url(cls, value: str | None) -> str | None:
        if value is not None and not (value.startswith("file:///") or
                                      (value.startswith("tcp://") and value.rpartition(":")[2].isdigit())):
            raise ValueError(f"init_method must be tcp://HOST:PORT or file:///PATH, got {value!r}")
        return value


DEFAULT_PORTS = {"http": 80, "https": 443}


def origin(url: str) -> str:
    """``scheme://host:port`` of an http(s) URL, the port explicit and the host lower-case (what two spellings
    of one peer share); ValueError for anything else."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise ValueError(f"{url!r} is not an http(s) URL") from None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL with a host (e.g. http://10.0.0.1:8100)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port or DEFAULT_PORTS[parts.scheme]}"


class KVTransportConfig(Strict):
    """Knobs of the KV transport engine. Sizes accept units: ``chunk_size=4MiB``."""

    preset: str | None = Field(None, description="Transport preset these values started from.")
    backend: TransportBackend = "auto"
    target_dtype: TransportDtype | None = Field(
        None, description="Convert KV to this dtype on the wire (None: send as stored)."
    )
    chunk_size: ByteSize = Field(ByteSize(4 * 1024 * 1024), description="Bytes per transfer chunk.")
    max_inflight: int = Field(8, ge=1, le=1024, description="Chunks in flight per transfer.")
    timeout_s: float = Field(30.0, gt=0, le=3600, description="Deadline for one transfer.")
    checksum: Literal["crc32c", "none"] = Field(
        "crc32c", description="Per-chunk payload checksum. crc32c (default, every backend): a bad copy, a "
        "scribbled shared-memory ring or a flipped bit on the wire is caught and the chunk resent, for one "
        "CRC32C pass over each chunk (its speed: docs/benchmarks.md, \"KV tiers\"). none: trust the link (a "
        "receiver accepts it only when it is set to none too).")
    process_group: ProcessGroupConfig = Field(ProcessGroupConfig(), description="The torch.distributed group "
                                              "of backend torchdist.")

    allowed_peers: list[str] = Field(
        default_factory=list, description="Prefill instances (http(s)://host:port) a decode worker may pull KV "
        "from when the request names them itself: behind a router or proxy that does not sign what it names "
        "(sage's router signs with the API key). Empty: with an API key only router-signed pulls, without one any "
        "URL. Set: also without an API key, only these.")
    auth_token: SecretStr | None = Field(
        None, description="The deployment's shared token (at least 16 characters; never printed). Set: every shm "
        "or tcp connection starts with an HMAC-SHA256 challenge-response both ways, and a peer without the same "
        "token is refused before any KV moves. None: no check (shm sockets are private to the user, tcp binds "
        "loopback unless told otherwise). torchdist has no handshake: membership of the process group is its "
        "boundary. Pass it as SAGE_KV_TRANSPORT__AUTH_TOKEN or in a config file rather than on the command line.")

    @field_validator("allowed_peers")
    @classmethod
    def _peer_origins(cls, value: list[str]) -> list[str]:
        return [origin(url) for url in value]

    @field_validator("auth_token")
    @classmethod
    def _token_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_TOKEN:
            raise ValueError(f"auth_token must be at least {MIN_TOKEN} characters (e.g. python -c 'import secrets; "
                             "print(secrets.token_urlsafe(32))')")
        return value

    @field_validator("chunk_size")
    @classmethod
    def _chunk_in_range(cls, value: ByteSize) -> ByteSize:
        if not MIN_CHUNK <= int(value) <= MAX_CHUNK:
            raise ValueError(f"chunk_size must be between 4KiB and 1GiB, got {value.human_readable()}")
        return value


class TransportPreset(Strict):
    """A named bundle of `KVTransportConfig` values (``presets/transport/NAME.yaml``)."""

    name: str
    description: str = ""
    kv_transport: KVTransportConfig = Field(description="KVTransportConfig fields this preset sets.")

    def values(self) -> dict:
        """Only the fields the preset file set (so lower layers keep theirs)."""
        return self.kv_transport.model_dump(exclude_unset=True, mode="json")
