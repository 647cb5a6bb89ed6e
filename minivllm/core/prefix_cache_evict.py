"""Eviction from the prefix cache, mirroring vllm/v1/core/block_pool.py
``_maybe_evict_cached_block`` and ``reset_prefix_cache``.

Eviction is lazy (block_pool.py): a freed block keeps its hash until ``get_new_blocks`` hands it
out again, and only then leaves ``cached_block_hash_to_block``; ``reset_prefix_cache`` forgets
every hash at once. Loaded the first time either happens: the article's examples never reuse a
block that held a hash, and never read this file.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minivllm.core.block_pool import BlockPool
    from minivllm.core.kv_cache_utils import KVCacheBlock


def maybe_evict_cached_block(pool: "BlockPool", block: "KVCacheBlock") -> bool:
    """Take ``block`` out of the prefix cache and drop its hash; False if it held none."""
    block_hash = block.block_hash
    if block_hash is None:
        return False
    candidates = pool.cached_block_hash_to_block.get(block_hash)
    if candidates is None or candidates.pop(block.block_id, None) is None:
        return False
    if not candidates:
        del pool.cached_block_hash_to_block[block_hash]
    block.reset_hash()
    return True


def reset_prefix_cache(pool: "BlockPool") -> bool:
    """Forget every cached hash. Only allowed when no request holds a block (only the null block
    is in use); returns whether it happened."""
    num_used_blocks = pool.num_gpu_blocks - pool.get_num_free_blocks()
    if num_used_blocks != 1:
        return False
    pool.cached_block_hash_to_block = {}
    for block in pool.blocks:
        block.reset_hash()
    return True
