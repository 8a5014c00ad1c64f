"""What `kv_connector_extra_config` may say, checked once when vLLM builds the connector.

    kv_transfer_config={
        "kv_connector": "SageKVConnector",
        "kv_connector_module_path": "sage_infer.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",   # a block that fails to load is recomputed
        "kv_connector_extra_config": {"disk_path": "/var/cache/sage-kv", "disk_bytes": 8 << 30,
                                      "remote_url": "redis://127.0.0.1:6379/0"},
    }
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sage_infer.config.serve import QuotaConfig
from sage_infer.errors import ConfigError

CONNECTOR_CLASS = "SageKVConnector"
CONNECTOR_MODULE = "sage_infer.integrations.vllm.connector"
GiB = 1 << 30


class SageConnectorConfig(BaseModel):
    """The stores behind the connector: a local disk directory, a Redis server, or both (disk first)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    disk_path: str | None = None  # one vLLM instance per directory (the connector locks it)
    disk_bytes: int = Field(4 * GiB, gt=0)
    remote_url: str | None = None  # redis://, rediss:// or unix:// (shared by every instance that uses it)
    remote_bytes: int = Field(GiB, gt=0)
    remote_timeout_s: float = Field(0.5, gt=0)  # a dead Redis costs one timeout per call, then a miss
    save_pending_bytes: int = Field(256 << 20, gt=0)  # saves queued for the store past this are dropped
    save_decode: bool = True  # also save blocks filled by generated tokens (multi-turn reuse)
    model_revision: str | None = None  # part of the block key; vLLM's `revision` when unset
    stats_path: str | None = None  # the worker writes its counters here (JSON) after each step that moved one
    # sage's policies over the disk store, as over the native engine's tiers (see disk_index.py)
    eviction: Literal["lru", "lfu", "arc", "s3fifo", "sage"] = "lru"  # which disk blocks go when it is full
    quota: QuotaConfig = QuotaConfig()  # tenant shares of the disk store, tenants by cache_salt
    hardware_preset: str | None = None  # admission: blocks whose load costs more than recomputing are not saved
    # prefill/decode separation (kv_role kv_producer / kv_consumer; see pd_transfer.py)
    pd_host: str = "127.0.0.1"  # producer: where its worker answers pulls; consumer (tcp): where it receives
    pd_port: int | None = Field(None, ge=1, le=65535)  # producer: the pull port (required)
    pd_backend: Literal["shm", "tcp"] = "shm"  # shm: one host; tcp: across hosts (both instances the same)
    pd_timeout_s: float = Field(30.0, gt=0)  # a consumer waits this long for a transfer; a producer holds this long
    pd_hold_bytes: int = Field(GiB, gt=0)  # producer: prompt blocks held for consumers, oldest dropped past this
    role: Literal["kv_both", "kv_producer", "kv_consumer"] = "kv_both"  # vLLM's kv_role, set by `parse`

    @model_validator(mode="after")
    def _check_role(self) -> SageConnectorConfig:
        if self.role == "kv_both" and not self.disk_path and not self.remote_url:
            raise ValueError("set disk_path, remote_url or both")
        if self.role == "kv_producer" and self.pd_port is None:
            raise ValueError("kv_role kv_producer needs pd_port: the port its worker answers decode instances on")
        if not self.disk_path and (self.quota.tenants or self.hardware_preset):
            raise ValueError("quota and hardware_preset apply to the disk store: set disk_path (a shared Redis is "
                             "bounded by its own LRU)")
        return self

    @property
    def has_store(self) -> bool:
        return bool(self.disk_path or self.remote_url)

    @classmethod
    def parse(cls, extra: dict[str, Any] | None, role: str = "kv_both") -> SageConnectorConfig:
        """`kv_connector_extra_config` (and vLLM's `kv_role`) -> config; a bad value is one `ConfigError` line
        naming the field."""
        try:
            return cls.model_validate({**(extra or {}), "role": role})
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            if where == "role":
                raise ConfigError(f"SageKVConnector: kv_role {role!r}: expected kv_both, kv_producer or "
                                  "kv_consumer") from None
            where = f" {where}:" if where else ""
            raise ConfigError(f"SageKVConnector kv_connector_extra_config:{where} {first['msg']}") from None


def kv_transfer_config(
    disk_path: str | None = None, remote_url: str | None = None, *, role: str = "kv_both", **extra: Any
) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict that loads `SageKVConnector` into vLLM (validated here first)."""
    settings = {k: v for k, v in {"disk_path": disk_path, "remote_url": remote_url, **extra}.items() if v is not None}
    SageConnectorConfig.parse(settings, role)
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": settings,
    }
