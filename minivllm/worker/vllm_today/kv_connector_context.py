"""vLLM 0.32's connector calls around the forward (``KVTransferConfig(kv_connector_context=
"vllm_today")``), an override of the article's ``KVConnectorModelRunnerMixin``
(worker/kv_connector_model_runner_mixin.py), and the context ``defer_finalize`` uses under spec
decode whenever the drafter's layers move with the target's. Mirrors
vllm/v1/worker/kv_connector_model_runner_mixin.py ``_get_kv_connector_output`` and
``kv_connector_no_forward``. Article steps (P/D): "Context manager" (``pd.enter``, ``pd.exit``).

Where it differs from the article:
- ``start_load_kv`` runs before the forward only when ``scheduler_output.has_sync_kv_loads`` (a
  synchronous load feeds this very forward); otherwise after it, keeping the launch of asynchronous
  loads off the forward's path.
- ``wait_for_save`` runs on every step, the one without a forward included (vLLM's base.py: "called
  once per step, including empty steps").
- ``defer_finalize``: leaving the context does not finalize. The metadata stays bound while the
  drafter runs, so the drafter's layers save (P) and load (D) with the target's; the runner calls
  ``finalize_kv_connector`` after the drafter.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from minivllm.distributed.kv_transfer.base import KVConnectorOutput
from minivllm.forward_context import get_forward_context, set_forward_context
from minivllm.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin


@contextmanager
def get_kv_connector_output(runner: KVConnectorModelRunnerMixin, scheduler_output: Any,
                            start_after_forward: bool = True, wait_for_save: bool = True,
                            defer_finalize: bool = False) -> Iterator[KVConnectorOutput]:
    """``start_after_forward``: the vLLM 0.32 order (the call moves after the forward unless the
    step has a synchronous load); ``False`` keeps the article's order (``defer_finalize`` alone).
    A function (vLLM's is a static method): both 0.32 overlays enter it, and it changes the
    runner only through the runner's own methods."""
    connector = runner.kv_connector
    output = runner.bind_kv_connector_metadata(scheduler_output)
    start_after_forward = start_after_forward and not scheduler_output.has_sync_kv_loads
    finalized = False
    try:
        if not start_after_forward:
            connector.start_load_kv(get_forward_context())
        yield output
        finalized = defer_finalize   # the runner finalizes after the drafter
    finally:
        try:
            if start_after_forward:   # no load feeds this forward
                connector.start_load_kv(get_forward_context())
        finally:
            if not finalized:
                runner.finalize_kv_connector(scheduler_output, output, wait_for_save)


class VllmTodayKVConnectorMixin(KVConnectorModelRunnerMixin):
    """Overrides ``maybe_get_kv_connector_output`` and ``kv_connector_no_forward``."""

    def maybe_get_kv_connector_output(self, scheduler_output: Any):
        return get_kv_connector_output(self, scheduler_output)

    def kv_connector_no_forward(self, scheduler_output: Any) -> KVConnectorOutput:
        """A step with nothing scheduled, vLLM 0.32's way: ``wait_for_save`` runs here too."""
        with set_forward_context(None, {}, self.kv_connector):
            with get_kv_connector_output(self, scheduler_output) as output:
                pass
        return output
