"""Typed configuration: pydantic models, YAML presets, and precedence resolution."""

from sage_infer.config.hardware import HardwareProfile
from sage_infer.config.resolve import ResolvedConfig, resolve_config
from sage_infer.config.serve import (
    KVPoolConfig,
    ModelConfig,
    PolicyConfig,
    SchedulerConfig,
    ServeConfig,
    TierConfig,
)
from sage_infer.config.transport import KVTransportConfig

__all__ = [
    "HardwareProfile",
    "KVPoolConfig",
    "KVTransportConfig",
    "ModelConfig",
    "PolicyConfig",
    "ResolvedConfig",
    "SchedulerConfig",
    "ServeConfig",
    "TierConfig",
    "resolve_config",
]
