"""`SageKVConnector`: sage's block hashing and KV tiers (disk, Redis) inside vLLM.

vLLM loads the connector by module path, so importing this package does not import vLLM;
`sage_infer.integrations.vllm.connector` does. `kv_transfer_config(...)` builds the dict to
pass as ``LLM(..., kv_transfer_config=...)``. See docs/vllm_connector.md.
"""

from sage_infer.integrations.vllm.config import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    SageConnectorConfig,
    kv_transfer_config,
)

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "SageConnectorConfig", "kv_transfer_config"]
