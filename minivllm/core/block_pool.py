"""The pool of KV cache blocks, mirroring vllm/v1/core/block_pool.py.

``BlockPool`` owns ``KVCacheBlock(0 .. num_gpu_blocks - 1)`` (the page ids of every layer's
``kv_cache [2, num_gpu_blocks, block_size, num_kv_heads, head_dim]``), the free queue, and the prefix cache
``cached_block_hash_to_block``. Eviction is lazy: a freed block keeps its hash and stays a possible prefix hit
until ``get_new_blocks`` hands it to someone else, and only then leaves the hash map
(``_maybe_evict_cached_block``); ``reset_prefix_cache`` forgets every hash at once.

Block 0 is the ``null_block``: popped once at start-up and never handed out or freed, so usable blocks are
``num_gpu_blocks - 1`` and real block ids start at 1 (padding in a block table can point at 0 harmlessly).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Optional

from minivllm.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock

if TYPE_CHECKING:
    from minivllm.request import Request


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        if num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be at least 1 (block 0 is the null block), "
                             f"got {num_gpu_blocks}.")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # No de-duplication: two requests that computed the same block at the same time both keep their
        # own copy (a block table may only grow at its end), so one hash can map to several blocks.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(self, block_hash: BlockHash,
                         token_ids_for_verification: Sequence[int]) -> Optional[KVCacheBlock]:
        """A cached block with this hash that really holds these tokens, or ``None``."""
        candidates = self.cached_block_hash_to_block.get(block_hash)
        if not candidates:
            return None
        expected = tuple(token_ids_for_verification)
        for block in candidates.values():
            if block.block_token_ids == expected:
                return block
        return None  # a hash collision: same hash, different tokens

    def cache_full_blocks(self, request: "Request", blocks: list[KVCacheBlock], num_cached_blocks: int,
                          num_full_blocks: int, block_size: int) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` (now full of computed tokens) into the cache.

        Hashes come from ``request.block_hashes``, which the request's block hasher keeps up to date.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        if len(request.block_hashes) < num_full_blocks:
            raise RuntimeError(
                f"Request {request.request_id} has {len(request.block_hashes)} block hashes but "
                f"{num_full_blocks} full blocks; was it built with get_request_block_hasher(block_size)?")
        token_ids = request.all_token_ids
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            block_hash = request.block_hashes[i]
            block.block_hash = block_hash  # raises if the block is already cached
            block.set_block_token_ids(token_ids[i * block_size:(i + 1) * block_size])
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the front of the free queue (LRU first), evicting their cached content."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                             f"({self.get_num_free_blocks()} free)")
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            if self.enable_caching and block.block_hash is not None:   # evicted only now
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """A block handed out again leaves the prefix cache: take it out of
        ``cached_block_hash_to_block`` and drop its hash; False if it held none."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        candidates = self.cached_block_hash_to_block.get(block_hash)
        if candidates is None or candidates.pop(block.block_id, None) is None:
            return False
        if not candidates:
            del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; a free one leaves the free queue so it is not evicted."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 rejoin the free queue, in the order given
        (the first is evicted first). A block with no full hash can never be a prefix hit, so it goes to
        the head, reused before any cached block; a cached one goes to the tail (LRU), as vLLM does.

        Callers pass a request's blocks in reverse, so its tail blocks (the least shareable) are evicted
        before its prefix blocks.
        """
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                cached = self.enable_caching and block.block_hash is not None
                (evict_last if cached else evict_first).append(block)
        self.free_block_queue.prepend_n(evict_first)
        self.free_block_queue.append_n(evict_last)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no request holds a block (only the null
        block is in use); returns whether it happened."""
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (all but the null block) that some request holds."""
        total_gpu_blocks = self.num_gpu_blocks - 1
        if not total_gpu_blocks:
            return 0.0
        return 1.0 - (self.get_num_free_blocks() / total_gpu_blocks)

    def snapshot(self) -> dict[str, Any]:
        """The pool as plain data, for the ``"kv_cache"`` step record and for tests (vLLM has no such
        view): ``num_gpu_blocks``, ``num_free_blocks``, ``free_block_ids`` (in eviction order),
        ``cached_block_ids`` and every block's ``ref_cnts``."""
        return {
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_free_blocks": self.get_num_free_blocks(),
            "free_block_ids": [b.block_id for b in self.free_block_queue.get_all_free_blocks()],
            "cached_block_ids": sorted(
                bid for candidates in self.cached_block_hash_to_block.values() for bid in candidates),
            "ref_cnts": [b.ref_cnt for b in self.blocks],
        }
