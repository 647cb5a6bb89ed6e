"""``KVTransferConfig``'s checks for the options the article's P/D example leaves at their defaults:
the connector context (``"vllm_today"``, vLLM 0.32's order), the load-failure policy and the lease
of a pull connector. ``KVTransferConfig`` runs them on every construction; they read its fields
and never import ``config.py``.
"""
from __future__ import annotations

from typing import Protocol

KV_CONNECTOR_CONTEXTS = ("article", "vllm_today")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


class KVTransferFields(Protocol):
    """The ``KVTransferConfig`` fields these checks read."""
    kv_connector_context: str
    kv_load_failure_policy: str
    kv_lease_duration: float


def check_kv_transfer_options(ktc: KVTransferFields) -> None:
    """``ktc``: a ``KVTransferConfig``. Raises ``ValueError`` naming the field and what it allows."""
    if ktc.kv_connector_context not in KV_CONNECTOR_CONTEXTS:
        raise ValueError(f"kv_transfer_config.kv_connector_context must be one of "
                         f"{KV_CONNECTOR_CONTEXTS}, got {ktc.kv_connector_context!r}.")
    if ktc.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
        raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                         f"got {ktc.kv_load_failure_policy!r}.")
    lease = ktc.kv_lease_duration
    if not isinstance(lease, (int, float)) or isinstance(lease, bool) or lease <= 0:
        raise ValueError(f"kv_lease_duration must be a positive number of seconds, got {lease!r}.")
