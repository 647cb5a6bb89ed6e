"""KV transfer between engine instances (disaggregated prefill/decode), mirroring
vllm/distributed/kv_transfer/ (``kv_transfer_state.py``): the connectors' base, factory and the
worker-role connector's instantiation. The context manager around the forward (article, "Context
manager") is the model runner's, as in vLLM: ``worker/kv_connector_model_runner_mixin.py``.

vLLM keeps the worker's connector in a process global (``get_kv_transfer_group()``); minivllm
returns it instead and the worker keeps it, so P and D can share one Python process.
"""
from __future__ import annotations

from typing import Any, Optional

from minivllm.distributed.kv_transfer.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                   KVConnectorOutput, KVConnectorRole)
from minivllm.distributed.kv_transfer.factory import KVConnectorFactory, validate_kv_transfer_config

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorOutput", "KVConnectorRole",
           "KVConnectorFactory", "validate_kv_transfer_config", "ensure_kv_transfer_initialized"]


def ensure_kv_transfer_initialized(vllm_config: Any, kv_cache_config: Any = None) -> Optional[KVConnectorBase_V1]:
    """The worker-role connector (article step "Instantiation", inside the worker's init device
    procedure; vLLM 0.32 calls it from ``Worker.initialize_from_config`` with the
    ``kv_cache_config``), or ``None`` without a ``kv_transfer_config``."""
    ktc = vllm_config.kv_transfer_config
    if ktc is None or not ktc.kv_connector:
        return None
    return KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
