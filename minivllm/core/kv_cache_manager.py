"""The scheduler's view of the paged KV cache, mirroring vllm/v1/core/kv_cache_manager.py.

vLLM splits this into ``KVCacheManager`` -> a coordinator -> one ``SingleTypeKVCacheManager`` per KV cache
group (``FullAttentionManager`` for plain attention) -> one shared ``BlockPool``. minivllm has a single
full-attention group, so the coordinator and ``FullAttentionManager`` are folded into this class; their
state keeps vLLM's names (``req_to_blocks``, ``num_cached_block``) and so do their methods
(``find_longest_cache_hit``, ``get_num_blocks_to_allocate``, ``save_new_computed_blocks``,
``allocate_new_blocks``, ``cache_blocks``).

A request's tokens, left to right, as ``allocate_slots`` sees them::

    | computed (already has KV) | new prefix hits | new tokens (incl. drafts) | lookahead slots |
      request.num_computed_tokens  num_new_computed_tokens  num_new_tokens       num_lookahead_tokens

Blocks are names only: block ``b`` is page ``b`` of every layer's
``kv_cache [2, num_gpu_blocks, block_size, num_kv_heads, head_dim]``.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

from minivllm.core.block_pool import BlockPool
from minivllm.core.kv_cache_utils import BlockHash, KVCacheBlock, KVCacheBlocks
from minivllm.utils import cdiv

if TYPE_CHECKING:
    from minivllm.request import Request


@dataclass
class PrefixCacheStats:
    """Local prefix-cache counters (vllm/v1/metrics/stats.py), in tokens."""
    requests: int = 0
    queries: int = 0
    hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True, use_eagle: bool = False) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}.")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        # FullAttentionManager state: the blocks each request holds, in token order, and how many of
        # them (a prefix) are already entered in the prefix cache.
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.empty_kv_cache_blocks = KVCacheBlocks(([],))

    # ---- prefix cache lookup ----------------------------------------------------------------------
    def get_computed_blocks(self, request: "Request") -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of a request not yet scheduled: (blocks, num_new_computed_tokens).

        At most ``num_tokens - 1`` tokens can hit: the last prompt token must run through the model to
        produce the logits of the first output token.
        """
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return self.create_empty_block_list(), 0
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks = self.find_longest_cache_hit(
            request.block_hashes, request.all_token_ids, max_cache_hit_length)
        num_new_computed_tokens = len(computed_blocks) * self.block_size
        return self.create_kv_cache_blocks(computed_blocks), num_new_computed_tokens

    def record_prefix_cache_stats(self, request: "Request", num_hits: int) -> None:
        """Count one lookup in the prefix-cache stats. The scheduler calls it once a looked-up
        request is admitted, as vLLM does: a request looked up again and again while it waits
        (no room, or the connector asks to be asked later) counts once."""
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits)

    def find_longest_cache_hit(self, block_hashes: list[BlockHash], token_ids: list[int],
                               max_length: int) -> list[KVCacheBlock]:
        computed_blocks: list[KVCacheBlock] = []
        bs = self.block_size
        for i, block_hash in enumerate(block_hashes[:max_length // bs]):
            cached_block = self.block_pool.get_cached_block(block_hash, token_ids[i * bs:(i + 1) * bs])
            if cached_block is None:
                break  # a chain: after the first miss no later block can be a valid prefix
            computed_blocks.append(cached_block)
        if self.use_eagle and computed_blocks:
            # EAGLE needs the target model's hidden states at the last hit position, which are not
            # cached; recomputing the last hit block regenerates them.
            computed_blocks.pop()
        return computed_blocks

    # ---- allocation -------------------------------------------------------------------------------
    def allocate_slots(self, request: "Request", num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Optional[KVCacheBlocks] = None,
                       num_lookahead_tokens: int = 0,
                       delay_cache_blocks: bool = False) -> Optional[KVCacheBlocks]:
        """Make sure ``request`` has KV slots for its new tokens; return only the newly allocated blocks,
        or ``None`` (with nothing changed) when the pool cannot supply them."""
        # 1. Sliding-window block skipping (remove_skipped_blocks) does not apply to full attention.
        if num_new_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0")
        new_computed_block_list = (new_computed_blocks.blocks[0] if new_computed_blocks is not None
                                   else [])
        request_id = request.request_id

        # 2. Slots needed up to here, capped: positions past max_model_len are never written.
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                                   self.max_model_len)

        # 3. Check before touching anything, so that None leaves no side effects.
        num_blocks_to_allocate = self.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, new_computed_block_list)
        if num_blocks_to_allocate > self.block_pool.get_num_free_blocks():
            return None

        # 4. Claim the prefix hits (pulling free ones out of the free queue) before allocating, so
        # allocation cannot evict them.
        if self.enable_caching:
            self.block_pool.touch(new_computed_block_list)
        else:
            assert not new_computed_block_list, "prefix hits without prefix caching"
        self.save_new_computed_blocks(request_id, new_computed_block_list)

        # 5. Fresh blocks for the rest.
        new_blocks = self.allocate_new_blocks(request_id, num_tokens_need_slot)

        # 6. Cache full blocks of real tokens. Capping at num_tokens keeps drafts (which are counted in
        # num_new_tokens but not in all_token_ids) out of the prefix cache: they may be rejected.
        if not self.enable_caching or delay_cache_blocks:
            return self.create_kv_cache_blocks(new_blocks)
        num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
        self.cache_blocks(request, num_tokens_to_cache)
        return self.create_kv_cache_blocks(new_blocks)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock]) -> int:
        num_required_blocks = cdiv(num_tokens, self.block_size)
        num_new_blocks = (num_required_blocks - len(new_computed_blocks)
                          - len(self.req_to_blocks.get(request_id, ())))
        # A hit block with ref_cnt 0 sits in the free queue; claiming it takes it out of the free count
        # just as allocating a fresh block would.
        num_evictable_computed_blocks = sum(
            blk.ref_cnt == 0 and not blk.is_null for blk in new_computed_blocks)
        return num_new_blocks + num_evictable_computed_blocks

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        if request_id not in self.num_cached_block:
            # A new (or resumed) request: its hit blocks are its first blocks and are already cached.
            req_blocks = self.req_to_blocks[request_id]
            assert not req_blocks, f"request {request_id} already holds blocks"
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)
        else:
            # A running request gets no new prefix hits.
            assert not new_computed_blocks

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks[request_id]
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: "Request", num_computed_tokens: int) -> None:
        """Enter the request's blocks that are full within its first ``num_computed_tokens`` tokens into
        the prefix cache (also called directly once an async KV load finishes)."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        num_full_blocks = num_computed_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[request_id], num_cached_blocks,
                                          num_full_blocks, self.block_size)
        self.num_cached_block[request_id] = num_full_blocks

    def free(self, request: "Request") -> None:
        """Release a finished or preempted request's blocks, tail first, so its last blocks are evicted
        before its (more shareable) prefix."""
        req_blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(req_blocks))
        self.num_cached_block.pop(request.request_id, None)

    # ---- queries ----------------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks((list(self.req_to_blocks.get(request_id, [])),))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_num_common_prefix_blocks(self, running_request_id: str, num_running_requests: int) -> list[int]:
        """Per group, how many leading blocks every running request shares (cascade attention hint): a
        block held by all running requests has ``ref_cnt == num_running_requests``."""
        num_common_blocks = 0
        for block in self.req_to_blocks.get(running_request_id, []):
            if block.ref_cnt != num_running_requests:
                break
            num_common_blocks += 1
        return [num_common_blocks]

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def snapshot(self, request_ids: Optional[Iterable[str]] = None) -> dict[str, Any]:
        """The block tables and the pool as plain data, for the ``"kv_cache"`` step record and for
        tests (vLLM has no such view): ``block_tables`` {req_id: [block ids]} (every request holding
        blocks if ``request_ids`` is None) plus ``BlockPool.snapshot()``."""
        if request_ids is None:
            request_ids = list(self.req_to_blocks)
        block_tables = {rid: [b.block_id for b in self.req_to_blocks.get(rid, [])]
                        for rid in request_ids}
        return {"block_tables": block_tables, **self.block_pool.snapshot()}

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the counters gathered since the last call and start fresh ones."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def create_empty_block_list(self) -> KVCacheBlocks:
        return self.empty_kv_cache_blocks.new_empty()

    def create_kv_cache_blocks(self, blocks: list[KVCacheBlock]) -> KVCacheBlocks:
        return KVCacheBlocks((blocks,)) if blocks else self.create_empty_block_list()
