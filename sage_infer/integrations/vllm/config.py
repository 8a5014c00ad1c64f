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

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
    stats_path: str | None = None  # the worker writes its counters here (JSON) when vLLM shuts down

    @model_validator(mode="after")
    def _one_store(self) -> SageConnectorConfig:
        if not self.disk_path and not self.remote_url:
            raise ValueError("set disk_path, remote_url or both")
        return self

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> SageConnectorConfig:
        """`kv_connector_extra_config` -> config; a bad value is one `ConfigError` line naming the field."""
        try:
            return cls.model_validate(dict(extra or {}))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "kv_connector_extra_config"
            raise ConfigError(f"SageKVConnector kv_connector_extra_config: {where}: {first['msg']}") from None


def kv_transfer_config(
    disk_path: str | None = None, remote_url: str | None = None, *, role: str = "kv_both", **extra: Any
) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict that loads `SageKVConnector` into vLLM (validated here first)."""
    settings = {k: v for k, v in {"disk_path": disk_path, "remote_url": remote_url, **extra}.items() if v is not None}
    SageConnectorConfig.parse(settings)
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": settings,
    }
