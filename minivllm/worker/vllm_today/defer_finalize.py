"""vLLM 0.32's ``defer_finalize``, a mixin over the article's ``ModelRunner``: under P/D with a
drafter that keeps KV of its own (EAGLE, EAGLE-3, the draft model), vLLM 0.32 registers the
drafter's attention layers with the connector too and finalizes the connector after the drafter
ran. The drafter's KV then moves with the target's, so D's first draft pass reads P's draft KV
instead of slots nobody wrote. Only drafter layers with the target's KV layout can share the
connector's files; with others the drafter's KV stays local (it recomputes), as in the article.

The article's runner finalizes when the context manager is left (``wait_for_save`` on exit); here
the context leaves the metadata bound and ``sample_tokens`` finalizes after the drafts. Mirrors
``defer_finalize`` in vllm/v1/worker/gpu_model_runner.py and ``finalize_kv_connector`` in
vllm/v1/worker/kv_connector_model_runner_mixin.py.
"""
from __future__ import annotations

from typing import Any

from minivllm.worker.vllm_today.kv_connector_context import get_kv_connector_output


class DeferFinalizeMixin:
    """Overrides ``kv_connector_layers``, ``maybe_get_kv_connector_output`` and
    ``sample_tokens``."""
    defer_finalize = False   # set by kv_connector_layers once the layouts are known

    def kv_connector_layers(self) -> dict[str, Any]:
        layers = super().kv_connector_layers()
        ref = next(iter(layers.values())).kv_cache
        own = self.drafter.attn_layers()
        draft = {name: layer for name, layer in own.items()
                 if layer.kv_cache.shape[2:] == ref.shape[2:] and layer.kv_cache.dtype == ref.dtype}
        self.defer_finalize = bool(draft) and len(draft) == len(own)
        if self.defer_finalize:
            layers.update(draft)
            self.drafter.kv_connector = self.kv_connector
        return layers

    def maybe_get_kv_connector_output(self, scheduler_output: Any):
        if not self.defer_finalize:
            return super().maybe_get_kv_connector_output(scheduler_output)
        ktc = self.vllm_config.kv_transfer_config
        return get_kv_connector_output(
            self, scheduler_output, defer_finalize=True,
            start_after_forward=ktc.kv_connector_context == "vllm_today")

    def sample_tokens(self) -> Any:
        state = self.execute_model_state
        try:
            return super().sample_tokens()
        finally:
            if self.defer_finalize:
                # vLLM's finalize_kv_connector: wait_for_save after the drafter saved its layers.
                self.finalize_kv_connector(state.scheduler_output, state.kv_connector_output)
