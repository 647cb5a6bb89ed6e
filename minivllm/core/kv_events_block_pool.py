"""A ``BlockPool`` that reports its prefix cache's changes as KV events, mirroring the
``enable_kv_cache_events`` branches of vllm/v1/core/block_pool.py (``kv_event_queue``,
``take_events``) and the per-step publishing at the end of vLLM's ``Scheduler.update_from_output``.

Chosen at construction, beside the article's pool: with ``kv_events_config`` on,
``attach_kv_events`` gives the scheduler this pool before any block is used, and publishes one
``KVEventBatch`` after each step's ``update_from_output``. With events off (the default) the
article's ``BlockPool`` runs unchanged. No article step: the events serve the KV-aware routing of a
fleet of engines (disagg/fleet/), past the article.

- ``cache_full_blocks`` -> ``BlockStored``: the newly cached blocks' hashes (``request.block_hashes``,
  the prefix cache's own keys), the parent hash, their token ids, the block size;
- an eviction (a freed block handed out again, ``BlockPool._maybe_evict_cached_block``) -> ``BlockRemoved``;
- ``reset_prefix_cache`` -> ``AllBlocksCleared``.

As in vLLM, a hash computed by two requests at once is stored twice (no de-duplication) and reported
each time; an index that keeps a set per replica (disagg/fleet/kv_index.py) is right either way.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from minivllm.config import KVEventsConfig
from minivllm.core.block_pool import BlockPool
from minivllm.distributed.kv_events import (MEDIUM_GPU, AllBlocksCleared, BlockRemoved,
                                            BlockStored, KVEventBatch, make_publisher)

if TYPE_CHECKING:
    from minivllm.core.kv_cache_utils import KVCacheBlock
    from minivllm.request import Request


class KVEventsBlockPool(BlockPool):
    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        super().__init__(num_gpu_blocks, enable_caching)
        self.kv_event_queue: list = []

    def cache_full_blocks(self, request: "Request", blocks: list["KVCacheBlock"],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int) -> None:
        super().cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size)
        if num_cached_blocks >= num_full_blocks:
            return
        new = [i for i in range(num_cached_blocks, num_full_blocks) if not blocks[i].is_null]
        if not new:
            return
        parent = request.block_hashes[num_cached_blocks - 1] if num_cached_blocks else None
        self.kv_event_queue.append(BlockStored(
            block_hashes=[request.block_hashes[i] for i in new], parent_block_hash=parent,
            token_ids=request.all_token_ids[num_cached_blocks * block_size:
                                            num_full_blocks * block_size],
            block_size=block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=None))

    def _maybe_evict_cached_block(self, block: "KVCacheBlock") -> bool:
        block_hash = block.block_hash          # the eviction resets it
        evicted = super()._maybe_evict_cached_block(block)
        if evicted:
            self.kv_event_queue.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU))
        return evicted

    def reset_prefix_cache(self) -> bool:
        cleared = super().reset_prefix_cache()
        if cleared:
            self.kv_event_queue.append(AllBlocksCleared())
        return cleared

    def take_events(self) -> list:
        """The events since the last call (vLLM's ``BlockPool.take_events``)."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events


def attach_kv_events(engine_core: Any, config: KVEventsConfig, publisher: Any = None) -> Any:
    """Give ``engine_core``'s scheduler a ``KVEventsBlockPool`` (before any block is used) and
    publish each step's events as one ``KVEventBatch`` after ``update_from_output``, as vLLM's
    scheduler does. Returns the publisher (``ZmqEventPublisher.endpoint``: where it sends).
    ``publisher``: any object with ``publish(batch)`` and ``shutdown()`` to take the batches
    instead of the one ``config`` makes (the simulator keeps them in memory for its fleet)."""
    scheduler = engine_core.scheduler
    manager = scheduler.kv_cache_manager
    old = manager.block_pool
    if old.get_num_free_blocks() != old.num_gpu_blocks - 1:
        raise RuntimeError("KV events must be attached before the engine runs a request.")
    pool = KVEventsBlockPool(old.num_gpu_blocks, old.enable_caching)
    manager.block_pool = pool
    publisher = make_publisher(config) if publisher is None else publisher
    update_from_output = scheduler.update_from_output

    def update_and_publish(scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = update_from_output(scheduler_output, model_runner_output)
        events = pool.take_events()
        if events:
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
        return outputs

    scheduler.update_from_output = update_and_publish
    scheduler.kv_event_publisher = publisher
    return publisher


def with_kv_events(engine_core: Any, config: KVEventsConfig) -> Any:
    """``LLM(kv_events_config=...)``: when the config turns events on, the engine's pool reports
    its changes. Returns the publisher (``NullEventPublisher`` when off)."""
    if not config.enable_kv_cache_events:
        return make_publisher(None)
    return attach_kv_events(engine_core, config)
