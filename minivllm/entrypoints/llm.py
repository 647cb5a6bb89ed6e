"""``LLM``: the offline entry point, mirroring vllm/entrypoints/llm.py.

Every argument is checked before any weights are read (a bad value is a ``ValueError`` that names the
field and what is allowed). ``generate()`` adds every prompt, then loops ``LLMEngine.step()`` until all
requests are done, with a tqdm bar over finished requests.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from minivllm.config import (LEARNED_DRAFTER_METHODS, CacheConfig, DeviceConfig, KVEventsConfig,
                             KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig, VllmConfig)
from minivllm.engine.llm_engine import LLMEngine, PromptType
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams
from minivllm.utils import frozen_gc_heap

if TYPE_CHECKING:
    from minivllm.metrics import Metric

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _verify_drafter(spec: Optional[SpeculativeConfig], hf_config: Any,
                    model: str) -> Optional[SpeculativeConfig]:
    """The drafter's checkpoint against the target's (spec_decode/): a draft model's vocabulary,
    a learned head's shapes. -> the config, holding a head's resolved directory (a copy: the
    caller's config stays as given)."""
    if spec is None:
        return None
    spec.verify_with_hf_config(hf_config)
    if spec.method == "draft_model" and spec.model is not None:
        from minivllm.spec_decode.draft_model import validate_draft_model
        validate_draft_model(spec, hf_config)
    if spec.method in LEARNED_DRAFTER_METHODS:
        from minivllm.spec_decode.heads import validate_head
        spec = dataclasses.replace(spec, model=validate_head(spec, hf_config, model))
    return spec


def _load_tokenizer(model_config: ModelConfig, model_path: str) -> Any:
    if model_config.skip_tokenizer_init:
        return None
    from minivllm.model_executor.model_loader import load_tokenizer
    return load_tokenizer(model_path)


def _arm_breakpoints(break_at: Optional[Sequence[str]]) -> None:
    """The article-step breakpoints (minivllm/steps.py), loaded only when someone asks for one."""
    if break_at is not None or os.environ.get("MINIVLLM_BREAK") or "minivllm.steps" in sys.modules:
        from minivllm import steps
        steps.configure(break_at)


class LLM:
    """Offline generation. The arguments are vLLM's (``speculative_config``, ``kv_transfer_config``,
    ``block_size``, ``max_num_seqs`` ...) unless noted. Each is checked by its config class
    (config/) before any weights are read. ``async_scheduling=True`` is vLLM 0.32's asynchronous
    scheduling (core/sched/async_scheduler.py); outputs equal the default, the article's flow.
    """
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        speculative_config: Optional[Union[dict, SpeculativeConfig]] = None,
        kv_transfer_config: Optional[KVTransferConfig] = None,
        seed: int = 0,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        skip_tokenizer_init: bool = False,
        max_model_len: Optional[int] = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: Optional[int] = None,
        num_gpu_blocks_override: Optional[int] = None,
        dtype: str = "auto",
        device: str = "auto",
        attention_backend: str = "auto",
        kv_cache_memory_bytes: Optional[int] = None,
        enable_chunked_prefill: bool = True,
        break_at: Optional[Sequence[str]] = None,   # article-step breakpoints (minivllm/steps.py)
        async_scheduling: bool = False,
        logprobs_mode: str = "raw_logprobs",   # vLLM's; see minivllm/sample/ops/logprobs.py
        max_logprobs: int = 20,
        kv_events_config: Optional[dict] = None,   # vLLM's KVEventsConfig (config/kv_events.py)
        worker_cls: str = "auto",   # vLLM's ParallelConfig.worker_cls (config/parallel.py)
    ) -> None:
        _arm_breakpoints(break_at)   # an unknown id: ValueError, before any work
        # 1. The arguments, each checked by its config class: nothing is loaded yet.
        device_config = DeviceConfig(device=device, attention_backend=attention_backend)
        model_config = ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len,
                                   skip_tokenizer_init=skip_tokenizer_init, seed=seed,
                                   logprobs_mode=logprobs_mode, max_logprobs=max_logprobs)
        cache_config = CacheConfig(block_size=block_size,
                                   enable_prefix_caching=enable_prefix_caching,
                                   num_gpu_blocks_override=num_gpu_blocks_override,
                                   kv_cache_memory_bytes=kv_cache_memory_bytes)
        spec = SpeculativeConfig.from_dict(speculative_config)
        parallel_config = ParallelConfig(worker_cls=worker_cls)
        if kv_transfer_config is not None:
            from minivllm.distributed.kv_transfer.factory import validate_kv_transfer_config
            kv_transfer_config = validate_kv_transfer_config(kv_transfer_config)
        if kv_events_config is not None:   # vLLM's KV events: checked now, on once built
            from minivllm.core.kv_events_block_pool import with_kv_events
            kv_events_config = KVEventsConfig.from_any(kv_events_config)

        # 2. The checkpoint (GGUF conversion happens once), checked against the configs.
        from minivllm.model_executor.model_loader import load_hf_config, resolve_model_path
        model_path = resolve_model_path(model)
        hf_config = load_hf_config(model_path)
        model_config.verify_with_hf_config(hf_config)
        sched_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, enable_chunked_prefill=enable_chunked_prefill,
            max_num_batched_tokens=max_num_batched_tokens or max(
                4096, min(model_config.max_model_len, 8192)),
            async_scheduling=bool(async_scheduling))
        spec = _verify_drafter(spec, hf_config, model)
        self.vllm_config = VllmConfig(model_config, cache_config, sched_config, spec,
                                      kv_transfer_config, device=device_config.device,
                                      attention_backend=device_config.attention_backend,
                                      hf_config=hf_config, model_path=model_path,
                                      parallel_config=parallel_config)
        # 3. Build the engine: load weights, allocate the KV cache.
        self.llm_engine = LLMEngine(self.vllm_config, _load_tokenizer(model_config, model_path),
                                    extra_eos_token_ids=_generation_eos_ids(model_path))
        if kv_events_config is not None:
            with_kv_events(self.llm_engine.engine_core, kv_events_config)
        self._request_counter = 0

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries for "
                                 f"{len(prompts)} prompts: give one, or one per prompt.")
        # Validate every prompt before any of them is queued.
        for p in prompts:
            self.llm_engine.validate_prompt(p)
        engine = self.llm_engine
        ids = []
        for prompt, params in zip(prompts, params_list):
            req_id = str(self._request_counter)
            self._request_counter += 1
            engine.add_request(req_id, prompt, params)
            ids.append(req_id)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        with frozen_gc_heap():        # vLLM's EngineCore freezes its startup heap (utils.py)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        bar.close()
        return [finished[i] for i in ids]

    def get_metrics(self) -> list[Metric]:
        """The engine's counters, gauges and per-position vectors (vLLM's ``get_metrics``, which
        reads ``vllm.v1.metrics.reader.get_metrics_snapshot()``): see minivllm/metrics.py."""
        from minivllm.metrics import get_metrics_snapshot
        return get_metrics_snapshot(self)


def _generation_eos_ids(model_path: str) -> list[int]:
    """EOS ids from generation_config.json (vLLM adds these to every request's stop ids)."""
    import json
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.exists(path):
        return []
    eos = json.load(open(path)).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]
