"""kvtier's vLLM integration: ``--kv-transfer-config '{"kv_connector": "KVTierConnector",
"kv_connector_module_path": "kvtier.integrations.vllm", ...}'``.

The connector is imported on first use. What it does is engine-neutral and lives in
``kvtier.engine`` (the planner, the copier, the step orders and the job ledger); this package only
translates vLLM's objects and hooks. The worker half (``worker``) imports without vLLM.
"""

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.integrations.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
