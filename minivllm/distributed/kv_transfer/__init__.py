"""KV transfer between engine instances (disaggregated prefill/decode), mirroring
vllm/distributed/kv_transfer/ (``kv_transfer_state.py``) and the worker-side helpers of
vllm/v1/worker/kv_connector_model_runner_mixin.py.

vLLM keeps the worker's connector in a process global (``get_kv_transfer_group()``); minivllm
returns it instead and the worker keeps it, so P and D can share one Python process.

Model-runner use (article, "Context manager")::

    with set_forward_context(attn_metadata, layers, connector):
        with maybe_get_kv_connector_output(connector, scheduler_output) as kv_connector_output:
            hidden_states = model(input_ids, positions)   # layers call wait_for_layer_load / save_kv_layer

Two orders, chosen by ``KVTransferConfig.kv_connector_context``:

- "article" (default), the article's picture: on enter ``start_load_kv``, on exit ``wait_for_save``;
  a step with nothing scheduled binds the metadata and collects finished transfers, no save.
- "vllm_today", vLLM 0.32 (v1/worker/kv_connector_model_runner_mixin.py): on enter
  ``start_load_kv`` only when ``scheduler_output.has_sync_kv_loads`` (a synchronous load feeds this
  very forward); otherwise ``start_load_kv`` runs after the forward, keeping the launch of
  asynchronous loads off the forward's path. ``wait_for_save`` runs on every step, the one without a
  forward included (vLLM's base.py: "called once per step, including empty steps").

In both, with spec decode and a drafter whose layers the connector moves (``defer_finalize``), the
runner calls ``finalize_kv_connector`` after the drafter, as vLLM 0.32 does. vLLM 0.32's Model
Runner V2 (v1/worker/gpu/kv_connector.py) has no context manager: ``KVConnector.pre_forward`` and
``post_forward`` do the same work.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Optional

from minivllm.distributed.kv_transfer.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                   KVConnectorOutput, KVConnectorRole)
from minivllm.distributed.kv_transfer.factory import KVConnectorFactory, validate_kv_transfer_config
from minivllm.forward_context import get_forward_context, set_forward_context
from minivllm.steps import BREAKS, at_step

__all__ = ["KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorOutput", "KVConnectorRole",
           "KVConnectorFactory", "validate_kv_transfer_config", "ensure_kv_transfer_initialized",
           "maybe_get_kv_connector_output", "finalize_kv_connector",
           "kv_connector_no_forward"]


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

    With spec decode and a drafter whose layers are registered (``defer_finalize``) the runner
    calls it after the drafter ran, so the draft layers' saves are part of the step."""
    try:
        if wait_for_save:
            # Article: "On exit: kv_connector.wait_for_save is called."
            connector.wait_for_save()
            if BREAKS and at_step("pd.exit"): breakpoint()
        output.finished_sending, output.finished_recving = connector.get_finished(
            scheduler_output.finished_req_ids)
        output.invalid_block_ids = connector.get_block_ids_with_load_errors()
        output.kv_connector_stats = connector.get_stats()
    finally:
        connector.clear_connector_metadata()
    return output


def _vllm_today(connector: KVConnectorBase_V1) -> bool:
    ktc = getattr(connector, "_kv_transfer_config", None)
    return getattr(ktc, "kv_connector_context", "article") == "vllm_today"


@contextmanager
def _get_kv_connector_output(connector: KVConnectorBase_V1, scheduler_output: Any,
                             wait_for_save: bool = True,
                             defer_finalize: bool = False) -> Iterator[KVConnectorOutput]:
    output = KVConnectorOutput()
    if scheduler_output.kv_connector_metadata is not None:
        connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    start_after_forward = (_vllm_today(connector)
                           and not getattr(scheduler_output, "has_sync_kv_loads", False))
    finalized = False
    try:
        if not start_after_forward:
            # Article: "On enter: kv_connector.start_load_kv is called."
            connector.start_load_kv(get_forward_context())
        if BREAKS and at_step("pd.enter"): breakpoint()
        yield output
        finalized = defer_finalize   # the runner finalizes after the drafter
    finally:
        try:
            if start_after_forward:   # vLLM today: no load feeds this forward
                connector.start_load_kv(get_forward_context())
        finally:
            if not finalized:
                finalize_kv_connector(connector, scheduler_output, output, wait_for_save)


def maybe_get_kv_connector_output(connector: Optional[KVConnectorBase_V1], scheduler_output: Any,
                                  defer_finalize: bool = False):
    """Context manager yielding this step's ``KVConnectorOutput`` (``None`` without a connector).
    Enter it inside ``set_forward_context``: ``start_load_kv`` reads the layers from there.

    ``defer_finalize`` (vLLM 0.32, on whenever spec decode is): leaving the context does not
    finalize; the metadata stays bound while the drafter runs, so the drafter's layers save (P) and
    load (D) with the target's, and the caller runs ``finalize_kv_connector`` afterwards."""
    if connector is None:
        return nullcontext(None)
    return _get_kv_connector_output(connector, scheduler_output, defer_finalize=defer_finalize)


def kv_connector_no_forward(connector: KVConnectorBase_V1, scheduler_output: Any) -> KVConnectorOutput:
    """A step with nothing scheduled: still give the connector its metadata and collect finished
    transfers. The article's picture calls no ``wait_for_save`` here (there was no forward); vLLM
    today (``kv_connector_context="vllm_today"``, vLLM 0.32's ``kv_connector_no_forward``) does."""
    with set_forward_context(None, {}, connector):
        with _get_kv_connector_output(connector, scheduler_output,
                                      wait_for_save=_vllm_today(connector)) as output:
            pass
    return output
