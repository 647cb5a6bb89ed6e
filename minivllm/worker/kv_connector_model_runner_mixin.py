"""The model runner's KV-connector half, mirroring vllm/v1/worker/kv_connector_model_runner_mixin.py:
which layers the connector moves, the context manager around the forward (article, "Context
manager"), its end (``finalize_kv_connector``) and the step that has no forward. Mixed into the
runner only when the engine has a connector (``worker.get_model_runner_cls``), so ``kv_connector``
is never None here. The article's version; vLLM 0.32's order (``kv_connector_context="vllm_today"``)
and ``defer_finalize`` override these methods from ``worker/vllm_today/``.

Model-runner use::

    with set_forward_context(attn_metadata, layers, connector):
        with self.maybe_get_kv_connector_output(scheduler_output) as kv_connector_output:
            hidden_states = model(input_ids, positions)   # layers call wait_for_layer_load / save_kv_layer

vLLM keeps the worker's connector in a process global (``get_kv_transfer_group()``); minivllm's
runner keeps it in ``self.kv_connector``, so P and D can share one Python process.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from minivllm.distributed.kv_transfer.base import KVConnectorOutput
from minivllm.forward_context import get_forward_context, set_forward_context


class KVConnectorModelRunnerMixin:
    kv_connector: Any   # the worker-role connector
    model: Any

    def kv_connector_layers(self) -> dict[str, Any]:
        """The attention layers whose KV the connector saves and loads: the target's."""
        return dict(self.model.attn_layers())

    def maybe_get_kv_connector_output(self, scheduler_output: Any):
        """The P/D context manager around the forward, yielding this step's ``KVConnectorOutput``.
        Enter it inside ``set_forward_context``: ``start_load_kv`` reads the layers from there.
        (vLLM's returns a ``nullcontext`` without a connector: ``ModelRunner``'s own does that.)"""
        return self._get_kv_connector_output(scheduler_output)

    @contextmanager
    def _get_kv_connector_output(self, scheduler_output: Any) -> Iterator[KVConnectorOutput]:
        """Article, "Context manager": on enter ``start_load_kv``, on exit ``wait_for_save``."""
        connector = self.kv_connector
        output = self.bind_kv_connector_metadata(scheduler_output)
        try:
            # Article: "On enter: kv_connector.start_load_kv is called."
            connector.start_load_kv(get_forward_context())
            yield output
        finally:
            self.finalize_kv_connector(scheduler_output, output)

    def bind_kv_connector_metadata(self, scheduler_output: Any) -> KVConnectorOutput:
        """The start of a step's transfers: the scheduler's metadata reaches the worker's
        connector. -> the step's empty ``KVConnectorOutput``."""
        if scheduler_output.kv_connector_metadata is not None:
            self.kv_connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        return KVConnectorOutput()

    def finalize_kv_connector(self, scheduler_output: Any, output: KVConnectorOutput,
                              wait_for_save: bool = True) -> KVConnectorOutput:
        """The end of a step's transfers (vLLM's ``finalize_kv_connector``): ``wait_for_save``,
        then the finished transfers and load errors into ``output``, then
        ``clear_connector_metadata``. ``wait_for_save=False`` for a step without a forward:
        nothing was saved."""
        connector = self.kv_connector
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

    def kv_connector_no_forward(self, scheduler_output: Any) -> KVConnectorOutput:
        """A step with nothing scheduled, which the article's examples never take (an asynchronous
        load or a finished transfer can be all a step does): still give the connector its
        metadata and collect finished transfers; loads still start. The article's picture calls no
        ``wait_for_save`` here: there was no forward."""
        with set_forward_context(None, {}, self.kv_connector):
            output = self.bind_kv_connector_metadata(scheduler_output)
            try:
                self.kv_connector.start_load_kv(get_forward_context())
            finally:
                self.finalize_kv_connector(scheduler_output, output, wait_for_save=False)
        return output
