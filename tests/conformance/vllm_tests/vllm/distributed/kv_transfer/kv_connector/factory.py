"""vllm/distributed/kv_transfer/kv_connector/factory.py -> minivllm's (same register_connector)."""
from minivllm.distributed.kv_transfer.factory import KVConnectorFactory
from vllm import _missing

__getattr__ = _missing.module_getattr(__name__)
__all__ = ["KVConnectorFactory"]
