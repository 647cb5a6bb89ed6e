"""The model runner's KV-connector half, mirroring vllm/v1/worker/kv_connector_model_runner_mixin.py:
which layers the connector moves, the context manager around the forward, and the step that has no
forward. Mixed into the runner only when the engine has a connector (``worker.get_model_runner_cls``),
so ``kv_connector`` is never None here. The article's version; vLLM 0.32's order (``kv_connector_context="vllm_today"``) and
``defer_finalize`` override these methods from ``worker/vllm_today/``.
"""
from __future__ import annotations

from typing import Any, Optional


class KVConnectorModelRunnerMixin:
    kv_connector: Any   # the worker-role connector
    model: Any

    def kv_connector_layers(self) -> dict[str, Any]:
        """The attention layers whose KV the connector saves and loads: the target's."""
        return dict(self.model.attn_layers())

    def maybe_get_kv_connector_output(self, scheduler_output: Any):
        """The P/D context manager around the forward."""
        from minivllm.distributed.kv_transfer import maybe_get_kv_connector_output
        return maybe_get_kv_connector_output(self.kv_connector, scheduler_output)

    def kv_connector_no_forward(self, scheduler_output: Any) -> Optional[Any]:
        """A step with nothing scheduled: the connector still gets its metadata and reports the
        finished transfers."""
        from minivllm.distributed.kv_transfer.no_forward import kv_connector_no_forward
        return kv_connector_no_forward(self.kv_connector, scheduler_output)
