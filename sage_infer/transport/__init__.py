"""KV transport engine: chunked, pipelined, checksummed KV transfer between processes and hosts.

`TransportEngine` (engine.py) plans and runs transfers over a backend (`shm`, `tcp`,
`torchdist`; see base.py for the interface), converting the KV format on the way when
asked (format/converter.py). Every chunk carries the fixed header of wire.py.
"""

from sage_infer.transport.arena import SharedArena
from sage_infer.transport.buffers import KVReceiveBuffers
from sage_infer.transport.engine import TransportEngine
from sage_infer.transport.stats import Priority, TransferRecord

__all__ = ["KVReceiveBuffers", "Priority", "SharedArena", "TransferRecord", "TransportEngine"]
