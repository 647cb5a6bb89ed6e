"""The engine's configuration, as vLLM's ``vllm/config/`` package: one dataclass per file, named as
vLLM names them (``device.py``, ``model.py``, ``cache.py``, ``scheduler.py``, ``speculative.py``,
``kv_transfer.py``, ``kv_events.py``, ``parallel.py``) and ``VllmConfig`` holding them
(``vllm.py``); this file re-exports them, as vllm/config/__init__.py does. The article's two
examples build them: ``LLM(speculative_config={...})`` and ``KVTransferConfig(kv_connector=...,
kv_role=...)``.

Every ``__post_init__`` checks its fields on every construction and raises ``ValueError`` naming
the field and the allowed values, so a bad argument fails before any model weights are read.
"""
from minivllm.config.cache import CacheConfig
from minivllm.config.device import ATTENTION_BACKENDS, DeviceConfig
from minivllm.config.kv_events import KVEventsConfig
from minivllm.config.kv_transfer import (KV_CONNECTOR_CONTEXTS, KV_LOAD_FAILURE_POLICIES, KV_ROLES,
                                         KVTransferConfig)
from minivllm.config.model import DTYPES, ModelConfig
from minivllm.config.parallel import ParallelConfig
from minivllm.config.scheduler import SchedulerConfig
from minivllm.config.speculative import (DRAFT_SAMPLE_METHODS, LEARNED_DRAFTER_METHODS,
                                         NGRAM_MATCH_RULES, REJECTION_SAMPLE_METHODS,
                                         SPECULATIVE_METHODS, SpeculativeConfig)
from minivllm.config.vllm import VllmConfig

__all__ = [
    "ATTENTION_BACKENDS", "CacheConfig", "DRAFT_SAMPLE_METHODS", "DTYPES", "DeviceConfig",
    "KVEventsConfig", "KVTransferConfig", "KV_CONNECTOR_CONTEXTS", "KV_LOAD_FAILURE_POLICIES",
    "KV_ROLES", "LEARNED_DRAFTER_METHODS", "ModelConfig", "NGRAM_MATCH_RULES", "ParallelConfig",
    "REJECTION_SAMPLE_METHODS", "SPECULATIVE_METHODS", "SchedulerConfig", "SpeculativeConfig",
    "VllmConfig",
]
