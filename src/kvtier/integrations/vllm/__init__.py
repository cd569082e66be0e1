"""kvtier's vLLM integration: ``--kv-transfer-config '{"kv_connector": "KVTierConnector",
"kv_connector_module_path": "kvtier.integrations.vllm", ...}'``.

The connector is imported on first use, so the worker half and its metadata can be imported
(and tested) without pulling in the rest of vLLM.
"""

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.integrations.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
