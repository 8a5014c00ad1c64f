"""Shared contracts: the types every layer of sage_infer agrees on."""

from sage_infer.core.kv_schema import KVCacheSchema, KVDtype, KVLayout, ScaleLayout
from sage_infer.interfaces.backend import (
    BackendError,
    EngineDeadError,
    InferenceBackend,
    InvalidRequestError,
    QueueFullError,
)
from sage_infer.interfaces.capability import AcceleratorDescriptor
from sage_infer.interfaces.transport import KVChunk, TransportPlan

__all__ = [
    "AcceleratorDescriptor",
    "BackendError",
    "EngineDeadError",
    "InferenceBackend",
    "InvalidRequestError",
    "KVCacheSchema",
    "KVChunk",
    "KVDtype",
    "KVLayout",
    "QueueFullError",
    "ScaleLayout",
    "TransportPlan",
    ]
