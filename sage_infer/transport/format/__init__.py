"""KV format conversion on the transport path (see converter.py for the wire layout)."""

from sage_infer.transport.format.converter import (
    WIRE_FORMATS,
    ReconstructionError,
    decode,
    encode,
    encode_checksummed,
    encoded_nbytes,
    error_bound,
    is_lossless,
    reconstruction_error,
)

__all__ = [
    "WIRE_FORMATS",
    "ReconstructionError",
    "decode",
    "encode",
    "encode_checksummed",
    "encoded_nbytes",
    "error_bound",
    "is_lossless",
    "reconstruction_error",
]
