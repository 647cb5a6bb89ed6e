"""The connector's step without a forward (vLLM 0.32: ``kv_connector_no_forward`` in
vllm/v1/worker/kv_connector_model_runner_mixin.py), beside the article's context manager
(``__init__.py``): the model runner loads it only for a step that schedules no tokens, which the
article's examples never take (an asynchronous load or a finished transfer can be all a step does).
"""
from __future__ import annotations

from typing import Any

from minivllm.distributed.kv_transfer import bind_connector_metadata, finalize_kv_connector
from minivllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorOutput
from minivllm.forward_context import get_forward_context, set_forward_context


def kv_connector_no_forward(connector: KVConnectorBase_V1, scheduler_output: Any) -> KVConnectorOutput:
    """A step with nothing scheduled: still give the connector its metadata and collect finished
    transfers; loads still start (an asynchronous load may be all this step does). The article's
    picture calls no ``wait_for_save`` here: there was no forward."""
    with set_forward_context(None, {}, connector):
        output = bind_connector_metadata(connector, scheduler_output)
        try:
            connector.start_load_kv(get_forward_context())
        finally:
            finalize_kv_connector(connector, scheduler_output, output, wait_for_save=False)
    return output
