"""vllm/v1/core/kv_cache_manager.py -> minivllm/core/kv_cache_manager.py.

Translated: the constructor (a ``KVCacheConfig`` with one full-attention group); ``allocate_slots``
takes ``num_external_computed_tokens`` apart (minivllm counts them in ``num_new_tokens``; delta
row 8); ``get_computed_blocks`` returns vLLM's third value, ``shared_prefix_boundary`` (0: no
sparse-retention group; delta row 31); ``coordinator.single_type_managers[0]`` is the manager
itself (minivllm folds vLLM's coordinator and ``FullAttentionManager`` into it)."""
from __future__ import annotations

from types import SimpleNamespace

from minivllm.core import kv_cache_manager as _mini
from minivllm.core.kv_cache_utils import KVCacheBlocks
from vllm.v1.request import Request
from vllm import _missing
from vllm.v1.core.block_pool import BlockPool


class KVCacheManager(_mini.KVCacheManager):
    def __init__(self, kv_cache_config, max_model_len: int, enable_caching: bool = True,
                 use_eagle: bool = False, log_stats: bool = False,
                 enable_kv_cache_events: bool = False, hash_block_size=None,
                 scheduler_block_size=None, **kwargs):
        harmless = {"dcp_world_size": 1, "pcp_world_size": 1, "max_num_batched_tokens": None}
        for name, value in kwargs.items():
            if value != harmless.get(name, object()) and value is not None:
                _missing._raise(f"vllm.v1.core.kv_cache_manager.KVCacheManager({name}=...)")
        if enable_kv_cache_events:
            _missing._raise("vllm.v1.core.kv_cache_manager.KVCacheManager (KV events)")
        block_size = kv_cache_config.single_full_attention_block_size()
        super().__init__(kv_cache_config.num_blocks, block_size, max_model_len,
                         enable_caching=enable_caching, use_eagle=use_eagle)
        self.block_pool.__class__ = BlockPool
        self.block_pool.hash_block_size = hash_block_size or block_size
        self.log_stats = log_stats
        self.kv_cache_config = kv_cache_config

    @property
    def coordinator(self):
        return SimpleNamespace(single_type_managers=[self], block_pool=self.block_pool)

    def get_computed_blocks(self, request: Request):
        blocks, num_tokens = super().get_computed_blocks(request)
        return blocks, num_tokens, 0

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=None, num_lookahead_tokens=0,
                       num_external_computed_tokens=0, delay_cache_blocks=False, **kwargs):
        harmless = {"num_encoder_tokens": 0, "reserved_blocks": 0, "skip_zeroing_group_ids": (),
                    "full_sequence_must_fit": False, "has_scheduled_reqs": False}
        for name, value in kwargs.items():
            if name not in harmless or (value and value != harmless[name]):
                _missing._raise(f"vllm.v1.core.kv_cache_manager.allocate_slots({name}=...)")
        return super().allocate_slots(
            request, num_new_tokens + num_external_computed_tokens, num_new_computed_tokens,
            new_computed_blocks, num_lookahead_tokens=num_lookahead_tokens,
            delay_cache_blocks=delay_cache_blocks)

    def make_prefix_cache_stats(self):
        return super().make_prefix_cache_stats() if self.log_stats else None


class SchedulerKVCacheManager(_mini.KVCacheManager):
    """The manager a minivllm ``Scheduler`` builds, with minivllm's signatures (the scheduler
    calls them) and vLLM's ``coordinator`` view for the tests."""

    coordinator = KVCacheManager.coordinator


__getattr__ = _missing.module_getattr(__name__)
__all__ = ["KVCacheBlocks", "KVCacheManager", "Request"]
