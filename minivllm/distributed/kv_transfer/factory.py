"""Connector registry, mirroring vllm/distributed/kv_transfer/kv_connector/factory.py.

A small dict from ``kv_connector`` name to a loader of its class (imported on first use, as vLLM
does, so registering costs nothing). ``validate_kv_transfer_config`` runs in the ``LLM``
constructor *before* any weights are read, so a typo fails in milliseconds with the field's name.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, Optional

from minivllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole

if TYPE_CHECKING:
    from minivllm.config import KVTransferConfig, VllmConfig


class KVConnectorFactory:
    _registry: dict[str, Callable[[], type[KVConnectorBase_V1]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: "str | type[KVConnectorBase_V1]",
                           class_name: Optional[str] = None) -> None:
        """``register_connector(name, "pkg.module", "ClassName")`` (vLLM's form, lazy) or
        ``register_connector(name, ConnectorClass)``."""
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered.")
        if isinstance(module_path, type):
            cls._registry[name] = lambda: module_path
        else:
            cls._registry[name] = lambda: getattr(importlib.import_module(module_path), class_name)

    @classmethod
    def get_connector_class(cls, name: Optional[str]) -> type[KVConnectorBase_V1]:
        if name not in cls._registry:
            raise ValueError(f"kv_transfer_config.kv_connector must be one of "
                             f"{sorted(cls._registry)}, got {name!r}.")
        return cls._registry[name]()

    @classmethod
    def create_connector(cls, vllm_config: "VllmConfig", role: KVConnectorRole,
                         kv_cache_config: Any = None) -> KVConnectorBase_V1:
        """Article step "Instantiation": called once with role SCHEDULER (``Scheduler.__init__``)
        and once with role WORKER (``ensure_kv_transfer_initialized``)."""
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None and ktc.kv_connector, "create_connector needs a kv_transfer_config"
        connector_cls = cls.get_connector_class(ktc.kv_connector)
        return connector_cls(vllm_config, role, kv_cache_config)


def validate_kv_transfer_config(cfg: "KVTransferConfig | dict[str, Any] | None") -> "Optional[KVTransferConfig]":
    """Check ``kv_transfer_config`` before the model loads; returns it as a ``KVTransferConfig``.

    Raises ``ValueError`` naming the field: unknown connector, unknown extra-config key, missing
    ``shared_storage_path`` or one that cannot be created or written."""
    from minivllm.config import KVTransferConfig
    if cfg is None:
        return None
    if isinstance(cfg, dict):
        unknown = sorted(set(cfg) - set(KVTransferConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown keys {unknown}; allowed: "
                             f"{sorted(KVTransferConfig.__dataclass_fields__)}.")
        cfg = KVTransferConfig(**cfg)
    if not isinstance(cfg, KVTransferConfig):
        raise ValueError(f"kv_transfer_config must be a KVTransferConfig or a dict, got {type(cfg).__name__}.")
    if cfg.kv_connector is None:
        return cfg
    KVConnectorFactory.get_connector_class(cfg.kv_connector).validate_kv_transfer_config(cfg)
    return cfg


# The article's name ("SharedStorageConnector") and vLLM 0.32's ("ExampleConnector", factory.py
# there registers only this one) load the same class.
for _name in ("SharedStorageConnector", "ExampleConnector"):
    KVConnectorFactory.register_connector(
        _name, "minivllm.distributed.kv_transfer.shared_storage_connector", "SharedStorageConnector")
KVConnectorFactory.register_connector(
    "RedisStoreConnector",
    "minivllm.distributed.kv_transfer.redis_store_connector", "RedisStoreConnector")
KVConnectorFactory.register_connector(
    "ZmqPullConnector", "minivllm.distributed.kv_transfer.zmq_pull_connector", "ZmqPullConnector")
