"""``KVTransferConfig``: which connector moves KV between instances, and this instance's role;
mirrors vllm/config/kv_transfer.py. The article's disaggregated prefill/decode example:
``KVTransferConfig(kv_connector="SharedStorageConnector", kv_role="kv_both", ...)``, the connector
``pd.init.worker`` and ``pd.init.scheduler`` create.

Every field is checked on every construction, the options the article's example leaves at their
defaults too: a bad value is a ``ValueError`` naming the field and what it allows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTOR_CONTEXTS = ("article", "vllm_today")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class KVTransferConfig:
    """vLLM's KVTransferConfig.

    ``kv_load_failure_policy``: what a KV load that fails after the scheduler counted its tokens
    as computed costs. ``"recompute"`` (minivllm's default): the request is cut back to its first
    bad block and computes the rest itself, so a failure costs compute, never a request.
    ``"fail"`` (vLLM 0.32's default): the request finishes with ``FINISHED_ERROR``
    (``finish_reason == "error"``), the engine lives on and the server answers with an error.
    ``kv_lease_duration``: seconds a producer holds a finished request's blocks for a pull
    connector's reader before it frees them unread (vLLM's name and default, 30 s)."""
    kv_connector: Optional[str] = None
    kv_role: Optional[str] = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # The worker's connector context manager (worker/kv_connector_model_runner_mixin.py): "article"
    # (start_load_kv on enter, wait_for_save on exit, none on a step without a forward) or
    # "vllm_today" (vLLM 0.32: start_load_kv on enter only with has_sync_kv_loads, else after the
    # forward; wait_for_save on every step, also without a forward). minivllm-only field.
    kv_connector_context: str = "article"
    kv_load_failure_policy: str = "recompute"
    kv_lease_duration: float = 30.0

    def __post_init__(self) -> None:
        if self.kv_connector is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}.")
        if self.kv_connector_context not in KV_CONNECTOR_CONTEXTS:
            raise ValueError(f"kv_transfer_config.kv_connector_context must be one of "
                             f"{KV_CONNECTOR_CONTEXTS}, got {self.kv_connector_context!r}.")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}.")
        lease = self.kv_lease_duration
        if not isinstance(lease, (int, float)) or isinstance(lease, bool) or lease <= 0:
            raise ValueError(f"kv_lease_duration must be a positive number of seconds, got {lease!r}.")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)
