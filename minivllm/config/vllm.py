"""``VllmConfig``: the engine's whole configuration, one object holding the others; mirrors
vllm/config/vllm.py. What the article's ``LLM(...)`` builds from its arguments."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from minivllm.config.cache import CacheConfig
from minivllm.config.kv_transfer import KVTransferConfig
from minivllm.config.model import ModelConfig
from minivllm.config.parallel import ParallelConfig
from minivllm.config.scheduler import SchedulerConfig
from minivllm.config.speculative import SpeculativeConfig


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    speculative_config: Optional[SpeculativeConfig] = None
    kv_transfer_config: Optional[KVTransferConfig] = None
    device: str = "cpu"
    attention_backend: str = "torch"
    # Filled by the loader: the checkpoint's transformers config, and the resolved local path.
    hf_config: Any = None
    model_path: Optional[str] = None
    # vLLM's ParallelConfig: here only which worker class EngineCore builds ("auto": Worker).
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
