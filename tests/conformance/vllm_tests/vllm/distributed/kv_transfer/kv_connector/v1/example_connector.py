"""vLLM's ExampleConnector is the article's debugging connector, minivllm's SharedStorageConnector."""
from minivllm.distributed.kv_transfer.shared_storage_connector import (
    SharedStorageConnector as ExampleConnector)
from vllm import _missing

__getattr__ = _missing.module_getattr(__name__)
__all__ = ["ExampleConnector"]
