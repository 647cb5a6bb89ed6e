"""Plain-data views of the paged KV cache, for the scheduler's ``"kv_cache"`` step record
(core/sched/schedule_record.py) and for tests. vLLM's ``BlockPool`` and ``KVCacheManager`` have no
such view; it sits beside them, read only when a step is recorded. Also the walk behind
``FreeKVCacheBlockQueue.get_all_free_blocks`` and ``KVCacheBlock``'s ``repr`` (kv_cache_utils.py),
read only when something asks for them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

if TYPE_CHECKING:
    from minivllm.core.block_pool import BlockPool
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


def free_blocks_in_order(queue: "FreeKVCacheBlockQueue") -> list["KVCacheBlock"]:
    """Every block of the free queue, head (evicted first) to tail."""
    ret = []
    curr = queue.fake_free_list_head.next_free_block
    while curr is not None and curr is not queue.fake_free_list_tail:
        ret.append(curr)
        curr = curr.next_free_block
    return ret


def block_repr(block: "KVCacheBlock") -> str:
    """``KVCacheBlock(block_id=.., ref_cnt=.., block_hash=<8 hex digits>, prev_free_block=..,
    next_free_block=.., is_null=..)``."""
    # Only neighbours' ids: printing the neighbours themselves would recurse through the list.
    prev_id = block.prev_free_block.block_id if block.prev_free_block else None
    next_id = block.next_free_block.block_id if block.next_free_block else None
    h = block._block_hash.hex()[:8] if block._block_hash else None
    return (f"KVCacheBlock(block_id={block.block_id}, ref_cnt={block.ref_cnt}, block_hash={h}, "
            f"prev_free_block={prev_id}, next_free_block={next_id}, is_null={block.is_null})")


def block_pool_snapshot(pool: "BlockPool") -> dict[str, Any]:
    """``num_gpu_blocks``, ``num_free_blocks``, ``free_block_ids`` (in eviction order),
    ``cached_block_ids`` and every block's ``ref_cnts``."""
    return {
        "num_gpu_blocks": pool.num_gpu_blocks,
        "num_free_blocks": pool.get_num_free_blocks(),
        "free_block_ids": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        "cached_block_ids": sorted(
            bid for candidates in pool.cached_block_hash_to_block.values() for bid in candidates),
        "ref_cnts": [b.ref_cnt for b in pool.blocks],
    }


def kv_cache_snapshot(manager: "KVCacheManager",
                      request_ids: Optional[Iterable[str]] = None) -> dict[str, Any]:
    """``block_tables`` {req_id: [block ids]} (every request holding blocks if ``request_ids`` is
    None) plus the pool's snapshot (``block_pool_snapshot``)."""
    if request_ids is None:
        request_ids = list(manager.req_to_blocks)
    block_tables = {rid: [b.block_id for b in manager.req_to_blocks.get(rid, [])]
                    for rid in request_ids}
    return {"block_tables": block_tables, **block_pool_snapshot(manager.block_pool)}
