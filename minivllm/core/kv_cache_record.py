"""Plain-data views of the paged KV cache, for the scheduler's ``"kv_cache"`` step record
(core/sched/schedule_record.py) and for tests. vLLM's ``BlockPool`` and ``KVCacheManager`` have no
such view; it sits beside them, read only when a step is recorded, and reads them through their
public attributes without importing them."""
from __future__ import annotations

from typing import Any, Iterable, Optional


def block_pool_snapshot(pool: Any) -> dict[str, Any]:
    """Of a ``BlockPool``: ``num_gpu_blocks``, ``num_free_blocks``, ``free_block_ids`` (in eviction order),
    ``cached_block_ids`` and every block's ``ref_cnts``."""
    return {
        "num_gpu_blocks": pool.num_gpu_blocks,
        "num_free_blocks": pool.get_num_free_blocks(),
        "free_block_ids": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "cached_block_ids": sorted(
            bid for candidates in pool.cached_block_hash_to_block.values() for bid in candidates),
        "ref_cnts": [b.ref_cnt for b in pool.blocks],
    }


def kv_cache_snapshot(manager: Any,
                      request_ids: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """Of a ``KVCacheManager``: ``block_tables`` {req_id: [block ids]} (every request holding blocks if ``request_ids`` is
    None) plus the pool's snapshot (``block_pool_snapshot``)."""
    if request_ids is None:
        request_ids = list(manager.req_to_blocks)
    block_tables = {rid: [b.block_id for b in manager.req_to_blocks.get(rid, [])]
                    for rid in request_ids}
    return {"block_tables": block_tables, **block_pool_snapshot(manager.block_pool)}
