"""vllm/config -> minivllm/config/. vLLM's configs take many more fields; a field minivllm has
no counterpart for is accepted at vLLM's default (or a value that changes nothing here) and
raises ``NotInMinivllm`` otherwise, so that no test runs on a setting minivllm silently ignored."""
from __future__ import annotations

import os
from typing import Any, Optional

from minivllm import config as _mini
from vllm import _missing

# The checkpoints vLLM's scheduler tests name, by their max_position_embeddings (what vLLM reads
# from the Hugging Face config when max_model_len is None; no hub is reachable here).
MAX_POSITION_EMBEDDINGS = {"facebook/opt-125m": 2048, "Qwen/Qwen3-0.6B": 40960}


ANY = "any value"   # a field that changes nothing minivllm schedules (memory, remote code, ...)


def _take(kwargs: dict, absent: dict[str, Any], what: str) -> None:
    """Drop the fields minivllm has no counterpart for, raising for a value that would matter."""
    for name, harmless in absent.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if harmless is not ANY and value is not None and value not in harmless:
                _missing._raise(f"vllm.config.{what}({name}={value!r})")
    if kwargs:
        _missing._raise(f"vllm.config.{what}({', '.join(sorted(kwargs))}=...)")


def ModelConfig(model: str = "Qwen/Qwen3-0.6B", max_model_len: Optional[int] = None,
                dtype: str = "auto", seed: int = 0, skip_tokenizer_init: bool = False,
                **kwargs) -> _mini.ModelConfig:
    _take(kwargs, {"trust_remote_code": (True, False), "runner": ("auto", "generate"),
                   "tokenizer": ANY, "enforce_eager": ANY, "hf_overrides": ({},)},
          "ModelConfig")
    if max_model_len is None and os.path.isfile(os.path.join(model, "config.json")):
        from transformers import AutoConfig   # a local checkpoint: its config, as vLLM reads it
        max_model_len = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    if max_model_len is None:
        if model not in MAX_POSITION_EMBEDDINGS:
            _missing._raise(f"vllm.config.ModelConfig(model={model!r}): not a text checkpoint "
                            "whose max_model_len the adapter knows")
        max_model_len = MAX_POSITION_EMBEDDINGS[model]
    config = _mini.ModelConfig(model=model, dtype=dtype if dtype in _mini.DTYPES else "auto",
                               max_model_len=max_model_len,
                               skip_tokenizer_init=skip_tokenizer_init, seed=seed or 0)
    # vLLM's derived facts of a text-only decoder, which its test helpers read.
    config.is_encoder_decoder = False
    config.multimodal_config = None
    return config


def CacheConfig(block_size: int = 16, enable_prefix_caching: bool = True,
                num_gpu_blocks_override: Optional[int] = None, **kwargs) -> _mini.CacheConfig:
    _take(kwargs, {"gpu_memory_utilization": ANY, "cache_dtype": ("auto",), "swap_space": ANY,
                   "sliding_window": (), "prefix_caching_hash_algo": ("sha256",)},
          "CacheConfig")
    return _mini.CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                             num_gpu_blocks_override=num_gpu_blocks_override)


def SchedulerConfig(max_num_seqs: int = 128, max_num_batched_tokens: Optional[int] = None,
                    max_model_len: Optional[int] = None, long_prefill_token_threshold: int = 0,
                    enable_chunked_prefill: bool = True, async_scheduling: bool = False,
                    **kwargs) -> _mini.SchedulerConfig:
    """vLLM's default token budget is 2048 (``DEFAULT_MAX_NUM_BATCHED_TOKENS``)."""
    _take(kwargs, {"max_num_active_seqs": (), "long_prefill_token_threshold_adaptive": (False,),
                   "disable_chunked_mm_input": (False,), "is_encoder_decoder": (False,),
                   "watermark": (0.0,), "policy": ("fcfs",), "max_num_partial_prefills": (1,),
                   "scheduler_cls": (), "disable_hybrid_kv_cache_manager": (True, False)},
          "SchedulerConfig")
    return _mini.SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens or 2048,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill, async_scheduling=async_scheduling)


def SpeculativeConfig(model: Optional[str] = None, num_speculative_tokens: Optional[int] = None,
                      method: Optional[str] = None, prompt_lookup_max: Optional[int] = None,
                      prompt_lookup_min: Optional[int] = None, **kwargs) -> _mini.SpeculativeConfig:
    """n-gram only: every other method needs a draft checkpoint."""
    _take(kwargs, {"num_speculative_tokens_per_batch_size": ()}, "SpeculativeConfig")
    method = method or ("ngram" if model in ("ngram", "[ngram]") else None)
    if method != "ngram":
        _missing._raise(f"vllm.config.SpeculativeConfig(method={method!r}, model={model!r})")
    return _mini.SpeculativeConfig(method="ngram", num_speculative_tokens=num_speculative_tokens,
                                   prompt_lookup_min=prompt_lookup_min,
                                   prompt_lookup_max=prompt_lookup_max)


SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


# vLLM's connector names -> minivllm's: the article's debugging connector is vLLM's ExampleConnector;
# NixlConnector's pull flow is ZmqPullConnector's (NIXL/RDMA replaced by a ZeroMQ side channel).
CONNECTOR_NAMES = {"ExampleConnector": "SharedStorageConnector", "NixlConnector": "ZmqPullConnector"}


def KVTransferConfig(kv_connector: Optional[str] = None, kv_role: Optional[str] = None,
                     kv_connector_extra_config: Optional[dict] = None,
                     kv_load_failure_policy: str = "fail", **kwargs) -> _mini.KVTransferConfig:
    """vLLM 0.32's default load-failure policy is "fail" (minivllm's is "recompute")."""
    _take(kwargs, {"kv_buffer_device": ANY, "kv_connector_module_path": (),
                   "engine_id": ANY, "enable_permute_local_kv": (False,),
                   "kv_buffer_size": ANY}, "KVTransferConfig")
    return _mini.KVTransferConfig(
        kv_connector=CONNECTOR_NAMES.get(kv_connector, kv_connector), kv_role=kv_role,
        kv_connector_extra_config=dict(kv_connector_extra_config or {}),
        kv_load_failure_policy=kv_load_failure_policy)


def ParallelConfig(pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
                   tensor_parallel_size: int = 1, **kwargs) -> None:
    """One device: minivllm has no parallelism."""
    _take(kwargs, {}, "ParallelConfig")
    if (pipeline_parallel_size, data_parallel_size, tensor_parallel_size) != (1, 1, 1):
        _missing._raise("vllm.config.ParallelConfig (pipeline, data or tensor parallelism)")


def ObservabilityConfig(per_request_spec_decode_metrics: str = "none", **kwargs) -> None:
    _take(kwargs, {}, "ObservabilityConfig")
    if per_request_spec_decode_metrics != "none":
        _missing._raise("vllm.config.ObservabilityConfig(per_request_spec_decode_metrics)")


def DeviceConfig(device: str = "cpu") -> str:
    return device


def AttentionConfig(backend: Any = None, **kwargs) -> None:
    _take(kwargs, {}, "AttentionConfig")
    if backend is not None:
        _missing._raise(f"vllm.config.AttentionConfig(backend={backend!r})")


def VllmConfig(model_config=None, cache_config=None, scheduler_config=None,
               speculative_config=None, kv_transfer_config=None, device_config=None,
               parallel_config=None, observability_config=None, attention_config=None,
               **kwargs) -> _mini.VllmConfig:
    """The feature configs minivllm lacks (LoRA, EC transfer, diffusion, KV events, ...) must be
    None."""
    _take(kwargs, {name: () for name in ("diffusion_config", "ec_transfer_config",
                                          "lora_config", "kv_events_config",
                                          "structured_outputs_config", "compilation_config",
                                          "load_config", "multimodal_config")}, "VllmConfig")
    model_config = model_config or ModelConfig()
    scheduler_config = scheduler_config or SchedulerConfig()
    return _mini.VllmConfig(model_config=model_config, cache_config=cache_config or CacheConfig(),
                            scheduler_config=scheduler_config,
                            speculative_config=speculative_config,
                            kv_transfer_config=kv_transfer_config,
                            device=device_config if isinstance(device_config, str) else "cpu")


__getattr__ = _missing.module_getattr(__name__)
