"""kvtier's vLLM integration: ``--kv-transfer-config '{"kv_connector": "KVTierConnector",
"kv_connector_module_path": "kvtier.integrations.vllm", ...}'``."""

from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
