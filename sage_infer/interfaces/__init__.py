"""Shared contracts: the types every layer of sage_infer agrees on."""

from sage_infer.core.kv_schema import KVCacheSchema, KVDtype, KVLayout, ScaleLayout
from sage_infer.interfaces.backend import GenerateOutput, GenerateRequest, InferenceBackend, KVStats
from sage_infer.interfaces.capability import AcceleratorDescriptor, CapabilityDescriptor, LinkDescriptor
from sage_infer.interfaces.quantization import QuantizationProfile, WeightQuant
from sage_infer.interfaces.transport import KVChunk, TransportPlan

__all__ = [
    "AcceleratorDescriptor",
    "CapabilityDescriptor",
    "GenerateOutput",
    "GenerateRequest",
    "InferenceBackend",
    "KVCacheSchema",
    "KVChunk",
    "KVDtype",
    "KVLayout",
    "KVStats",
    "LinkDescriptor",
    "QuantizationProfile",
    "ScaleLayout",
    "TransportPlan",
    "WeightQuant",
]
