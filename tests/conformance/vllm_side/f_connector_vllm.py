"""Case f, vLLM side: ``LoggingExampleConnector``, vLLM 0.32's ExampleConnector with every public
method logged (f_calllog.py). vLLM loads it by ``kv_connector_module_path="f_connector_vllm"``
in the EngineCore and in the worker (this folder is on their PYTHONPATH)."""
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

from f_calllog import make_logging_class

LoggingExampleConnector = make_logging_class(ExampleConnector)
