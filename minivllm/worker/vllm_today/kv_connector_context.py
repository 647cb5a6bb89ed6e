"""vLLM 0.32's connector calls around the forward (``KVTransferConfig(kv_connector_context=
"vllm_today")``), a mixin over the article's ``KVConnectorModelRunnerMixin``: ``start_load_kv``
after the forward unless a synchronous load feeds it, ``wait_for_save`` on every step, the empty
ones included (distributed/kv_transfer/vllm_today.py)."""
from __future__ import annotations

from typing import Any, Optional

from minivllm.distributed.kv_transfer import vllm_today


class VllmTodayKVConnectorMixin:
    """Overrides ``maybe_get_kv_connector_output`` and ``kv_connector_no_forward``."""

    def maybe_get_kv_connector_output(self, scheduler_output: Any):
        return vllm_today.get_kv_connector_output(self.kv_connector, scheduler_output)

    def kv_connector_no_forward(self, scheduler_output: Any) -> Optional[Any]:
        return vllm_today.kv_connector_no_forward(self.kv_connector, scheduler_output)
