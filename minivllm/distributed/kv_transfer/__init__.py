"""KV transfer between engine instances (disaggregated prefill/decode), mirroring
vllm/distributed/kv_transfer/ (``kv_transfer_state.py``) and the worker-side helpers of
vllm/v1/worker/kv_connector_model_runner_mixin.py.

vLLM keeps the worker's connector in a process global (``get_kv_transfer_group()``); minivllm
returns it instead and the worker keeps it, so P and D can share one Python process.

Model-runner use (article, "Context manager")::

    with set_forward_context(attn_metadata, layers, connector):
        with maybe_get_kv_connector_output(connector, scheduler_output) as kv_connector_output:
            hidden_states = model(input_ids, positions)   # layers call wait_for_layer_load / save_kv_layer

On enter ``start_load_kv``, on exit ``wait_for_save``: the article's picture. vLLM 0.32 orders the
calls differently (``KVTransferConfig.kv_connector_context="vllm_today"``) and finalizes after the
drafter under spec decode (``defer_finalize``); both live beside this file, in
``vllm_today.py``, and the model runner picks them at construction
(``python -m minivllm.tour pd --then-and-now`` shows the two side by side).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Optional

from minivllm.distributed.kv_transfer.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                   KVConnectorOutput, KVConnectorRole)
from minivllm.distributed.kv_transfer.factory import KVConnectorFactory, validate_kv_transfer_config
from minivllm.forward_context import get_forward_context

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorOutput", "KVConnectorRole",
           "KVConnectorFactory", "validate_kv_transfer_config", "ensure_kv_transfer_initialized",
           "maybe_get_kv_connector_output", "finalize_kv_connector"]


def ensure_kv_transfer_initialized(vllm_config: Any, kv_cache_config: Any = None) -> Optional[KVConnectorBase_V1]:
    """The worker-role connector (article step "Instantiation", inside the worker's init device
    procedure; vLLM 0.32 calls it from ``Worker.initialize_from_config`` with the
    ``kv_cache_config``), or ``None`` without a ``kv_transfer_config``."""
    ktc = vllm_config.kv_transfer_config
    if ktc is None or not ktc.kv_connector:
        return None
    return KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)


def finalize_kv_connector(connector: KVConnectorBase_V1, scheduler_output: Any,
                          output: KVConnectorOutput, wait_for_save: bool = True) -> KVConnectorOutput:
    """The end of a step's transfers (vLLM's ``finalize_kv_connector``): ``wait_for_save``, then
    the finished transfers and load errors into ``output``, then ``clear_connector_metadata``.
    ``wait_for_save=False`` for a step without a forward: nothing was saved."""
    try:
        if wait_for_save:
            # Article: "On exit: kv_connector.wait_for_save is called."
            connector.wait_for_save()
        output.finished_sending, output.finished_recving = connector.get_finished(
            scheduler_output.finished_req_ids)
        output.invalid_block_ids = connector.get_block_ids_with_load_errors()
        output.kv_connector_stats = connector.get_stats()
    finally:
        connector.clear_connector_metadata()
    return output


def bind_connector_metadata(connector: KVConnectorBase_V1, scheduler_output: Any) -> KVConnectorOutput:
    """The start of a step's transfers: the scheduler's metadata reaches the worker's connector.
    -> the step's empty ``KVConnectorOutput``."""
    if scheduler_output.kv_connector_metadata is not None:
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    return KVConnectorOutput()


@contextmanager
def _get_kv_connector_output(connector: KVConnectorBase_V1,
                             scheduler_output: Any) -> Iterator[KVConnectorOutput]:
    """Article, "Context manager": on enter ``start_load_kv``, on exit ``wait_for_save``."""
    output = bind_connector_metadata(connector, scheduler_output)
    try:
        # Article: "On enter: kv_connector.start_load_kv is called."
        connector.start_load_kv(get_forward_context())
        yield output
    finally:
        finalize_kv_connector(connector, scheduler_output, output)


def maybe_get_kv_connector_output(connector: Optional[KVConnectorBase_V1], scheduler_output: Any):
    """Context manager yielding this step's ``KVConnectorOutput`` (``None`` without a connector).
    Enter it inside ``set_forward_context``: ``start_load_kv`` reads the layers from there."""
    if connector is None:
        return nullcontext(None)
    return _get_kv_connector_output(connector, scheduler_output)
