"""vllm/v1/core/sched/scheduler.py -> minivllm/core/sched/scheduler.py.

Translated at the edges only: the constructor (the block count from a one-group
``KVCacheConfig``); ``update_draft_token_ids`` takes vLLM's ``DraftTokenIds`` (delta row 23);
``update_from_output`` returns vLLM's ``{client_index: EngineCoreOutputs}``; ``make_stats`` gives the
prefix-cache and spec-decode counters. The scheduling itself is minivllm's."""
from __future__ import annotations

from types import SimpleNamespace

from minivllm.core.sched.async_scheduler import AsyncScheduler as _AsyncScheduler
from minivllm.core.sched.scheduler import Scheduler as _Scheduler
from vllm import _missing
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.kv_cache_manager import SchedulerKVCacheManager
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import FinishReason


class SchedulerAdapter:
    def __init__(self, vllm_config, kv_cache_config, structured_output_manager=None,
                 block_size=None, mm_registry=None, include_finished_set: bool = False,
                 log_stats: bool = False, hash_block_size=None, **kwargs):
        if structured_output_manager is not None or any(kwargs.values()):
            _missing._raise("vllm.v1.core.sched.scheduler.Scheduler(structured output / ...)")
        cache_block_size = kv_cache_config.single_full_attention_block_size()
        if cache_block_size != vllm_config.cache_config.block_size or (
                hash_block_size not in (None, cache_block_size)):
            _missing._raise("vllm.v1.core.sched.scheduler.Scheduler (a hash block size other "
                            "than the cache's)")
        super().__init__(vllm_config, num_gpu_blocks=kv_cache_config.num_blocks)
        self.kv_cache_manager.__class__ = SchedulerKVCacheManager
        self.kv_cache_config = kv_cache_config
        self.log_stats = log_stats
        self.include_finished_set = include_finished_set
        # State vLLM 0.32 keeps that minivllm has no counterpart of (so nothing can leak there):
        # the set of deferred waiting requests, in-flight prefills, KV fetch stages, the encoder
        # cache.
        self.deferred_waiting: set = set()
        self._inflight_prefills: set = set()
        self._kv_fetch_stages: dict = {}
        self._kv_fetch_counts: dict = {}
        self.encoder_cache_manager = SimpleNamespace(freed=[], cached={})
        # No encoder-cache connector, no structured output; Model Runner V1.
        self.ec_connector = None
        self.structured_output_manager = None
        self.use_v2_model_runner = False

    def update_draft_token_ids(self, draft_token_ids) -> None:
        super().update_draft_token_ids(dict(zip(draft_token_ids.req_ids,
                                                draft_token_ids.draft_token_ids)))

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        engine_outputs = [
            EngineCoreOutput(
                request_id=request.request_id, new_token_ids=list(new_token_ids),
                finish_reason=(FinishReason(request.get_finished_reason())
                               if request.is_finished() else None),
                stop_reason=request.stop_reason,
                kv_transfer_params=request.output_kv_transfer_params,
                num_cached_tokens=request.num_cached_tokens)
            for request, new_token_ids in outputs]
        if not engine_outputs and not self.log_stats:
            return {}
        return {0: EngineCoreOutputs(outputs=engine_outputs, scheduler_stats=self.make_stats())}

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """minivllm resets the prefix cache only when no request holds a block."""
        if reset_running_requests or reset_connector:
            _missing._raise("vllm Scheduler.reset_prefix_cache(reset_running_requests / connector)")
        return self.kv_cache_manager.reset_prefix_cache()

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.kv_holding_waiting)

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting) + len(self.kv_holding_waiting)

    def make_stats(self, spec_decoding_stats=None):
        if not self.log_stats:
            return None
        stats = self.spec_decoding_stats
        return SimpleNamespace(
            num_running_reqs=len(self.running), num_waiting_reqs=self.get_request_counts()[1],
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_stats=self.kv_cache_manager.make_prefix_cache_stats(),
            spec_decoding_stats=stats if stats is not None and stats.num_drafts else None)


class Scheduler(SchedulerAdapter, _Scheduler):
    pass


class AsyncScheduler(SchedulerAdapter, _AsyncScheduler):
    pass


__getattr__ = _missing.module_getattr(__name__)
__all__ = ["Scheduler", "SchedulerOutput"]
