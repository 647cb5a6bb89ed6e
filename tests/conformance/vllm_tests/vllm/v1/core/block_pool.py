"""vllm/v1/core/block_pool.py -> minivllm/core/block_pool.py (one KV-cache group: group 0)."""
from __future__ import annotations

from minivllm.core.block_pool import BlockPool as _BlockPool
from vllm import _missing


class BlockPool(_BlockPool):
    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int = 16,
                 enable_kv_cache_events: bool = False, **kwargs):
        if enable_kv_cache_events or any(kwargs.values()):
            _missing._raise("vllm.v1.core.block_pool.BlockPool(enable_kv_cache_events / ...)")
        super().__init__(num_gpu_blocks, enable_caching)
        self.hash_block_size = hash_block_size

    def get_cached_block(self, block_hash, token_ids_for_verification=None,
                         kv_cache_group_ids=None):
        """vLLM's call (``kv_cache_group_ids``): one block per group, or None if a group misses;
        vLLM passes no tokens to check, so any block with the hash counts. minivllm's own
        manager passes the tokens, as ever."""
        if kv_cache_group_ids is None:
            return super().get_cached_block(block_hash, token_ids_for_verification)
        if list(kv_cache_group_ids) != [0]:
            _missing._raise("vllm.v1.core.block_pool.BlockPool.get_cached_block (groups > 0)")
        candidates = self.cached_block_hash_to_block.get(block_hash)
        return [next(iter(candidates.values()))] if candidates else None

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id=0):
        if kv_cache_group_id != 0:
            _missing._raise("vllm.v1.core.block_pool.BlockPool.cache_full_blocks (groups > 0)")
        super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size)

    def touch(self, blocks):
        """vLLM takes one list per group."""
        if blocks and isinstance(blocks[0], (list, tuple)):
            (blocks,) = blocks
        super().touch(blocks)


__getattr__ = _missing.module_getattr(__name__)
