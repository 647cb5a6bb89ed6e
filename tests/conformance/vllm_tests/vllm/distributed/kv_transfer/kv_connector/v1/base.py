"""vllm/distributed/kv_transfer/kv_connector/v1/base.py -> minivllm/distributed/kv_transfer/base.py."""
from minivllm.distributed.kv_transfer.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                   KVConnectorRole)
from vllm import _missing

__getattr__ = _missing.module_getattr(__name__)
__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole"]
