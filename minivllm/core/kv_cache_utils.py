"""Paged-KV bookkeeping primitives, mirroring vllm/v1/core/kv_cache_utils.py.

No tensors live here. A ``KVCacheBlock`` is the *name* of one page of the KV cache: page ``block_id`` of
every layer's ``kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]``. The worker turns block ids
into slots (``slot = block_id * block_size + position % block_size``); this module only decides which ids a
request owns, which are free, and which still hold a reusable prefix.

Prefix caching identifies a *full* block by a chained hash: ``hash(parent_hash, this block's token ids,
extra keys)``, so equal hashes mean equal prefixes up to and including this block. minivllm has one KV cache
group, so vLLM's ``make_block_hash_with_group_id`` suffix (the group id as 4 bytes) is left out.
"""
from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from minivllm.request import Request

# sha256 digest of a full block (32 bytes).
BlockHash = bytes

# Parent hash of a request's first block. vLLM draws it at random unless PYTHONHASHSEED is set; a fixed
# value keeps minivllm's traces reproducible across runs.
NONE_HASH: BlockHash = hashlib.sha256(b"minivllm.NONE_HASH").digest()


def hash_block_tokens(
    parent_block_hash: Optional[BlockHash],
    curr_block_token_ids: Sequence[int],
    extra_keys: Optional[tuple[Any, ...]] = None,
) -> BlockHash:
    """sha256 over (parent hash or NONE_HASH, token count, int64 token ids, repr of extra keys).

    The token count prefix keeps the token bytes and the extra-key bytes from running into each other.
    """
    if parent_block_hash is None:
        parent_block_hash = NONE_HASH
    h = hashlib.sha256(parent_block_hash)
    n = len(curr_block_token_ids)
    h.update(struct.pack(f"<q{n}q", n, *curr_block_token_ids))
    if extra_keys:
        h.update(repr(tuple(extra_keys)).encode())
    return h.digest()


def generate_block_hash_extra_keys(request: "Request", start_token_idx: int) -> Optional[tuple[Any, ...]]:
    """Extra keys of one block. minivllm has no multimodal inputs or LoRA; ``cache_salt`` (if a request
    carries one) goes into the first block only, which is enough to separate the whole chain. Tagged
    as vLLM tags it, ``("cache_salt", salt)``, so that it cannot collide with another kind of key."""
    cache_salt = getattr(request, "cache_salt", None)
    if start_token_idx == 0 and cache_salt:
        return (("cache_salt", cache_salt),)
    return None


def get_request_block_hasher(block_size: int) -> Callable[["Request"], list[BlockHash]]:
    """Return ``request -> hashes of the full blocks not yet in request.block_hashes``.

    ``Request`` calls it in ``__init__`` (the prompt) and in ``append_output_token_ids`` (each new token),
    so ``request.block_hashes`` always covers exactly ``num_tokens // block_size`` blocks. Drafts are
    never in ``all_token_ids``, so they are never hashed.
    """

    def request_block_hasher(request: "Request") -> list[BlockHash]:
        start_token_idx = len(request.block_hashes) * block_size
        token_ids = request.all_token_ids
        num_tokens = len(token_ids)
        prev_block_hash = request.block_hashes[-1] if request.block_hashes else None
        new_block_hashes: list[BlockHash] = []
        while start_token_idx + block_size <= num_tokens:
            end_token_idx = start_token_idx + block_size
            extra_keys = generate_block_hash_extra_keys(request, start_token_idx)
            # Looked up through the module at call time so tests can monkeypatch it.
            block_hash = hash_block_tokens(
                prev_block_hash, token_ids[start_token_idx:end_token_idx], extra_keys)
            new_block_hashes.append(block_hash)
            prev_block_hash = block_hash
            start_token_idx = end_token_idx
        return new_block_hashes

    return request_block_hasher


# Identity equality: field-wise == would walk the whole free list. Slots: one object per block of
# the pool, so no per-block __dict__ (as vLLM's KVCacheBlock).
@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    # Number of requests holding this block; 0 means it sits in the free queue (possibly still cached).
    ref_cnt: int = 0
    _block_hash: Optional[BlockHash] = None
    # The token ids the block holds once it is cached; a hash hit is accepted only if these match, so a
    # hash collision cannot hand a request someone else's KV.
    _block_token_ids: Optional[tuple[int, ...]] = None
    prev_free_block: Optional["KVCacheBlock"] = None
    next_free_block: Optional["KVCacheBlock"] = None
    # The placeholder block id 0; never handed out, never freed.
    is_null: bool = False

    @property
    def block_hash(self) -> Optional[BlockHash]:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHash) -> None:
        if self._block_hash is not None:
            raise ValueError(f"Block {self.block_id} already has a hash; reset_hash() it first.")
        self._block_hash = block_hash

    @property
    def block_token_ids(self) -> Optional[tuple[int, ...]]:
        return self._block_token_ids

    def set_block_token_ids(self, token_ids: Sequence[int]) -> None:
        self._block_token_ids = tuple(token_ids)

    def reset_hash(self) -> None:
        """Forget the cached content; called when the block is evicted for reuse."""
        self._block_hash = None
        self._block_token_ids = None

    def __repr__(self) -> str:
        """``KVCacheBlock(block_id=.., ref_cnt=.., block_hash=<8 hex digits>, prev_free_block=..,
        next_free_block=.., is_null=..)``, for the debugger and the tests."""
        # Only neighbours' ids: printing the neighbours themselves would recurse through the list.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        h = self._block_hash.hex()[:8] if self._block_hash else None
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={h}, "
                f"prev_free_block={prev_id}, next_free_block={next_id}, is_null={self.is_null})")


class FreeKVCacheBlockQueue:
    """The free blocks as a doubly linked list threaded through the blocks themselves.

    A Python deque cannot remove from the middle in O(1), and a prefix hit must pull a free-but-cached
    block out of the middle (``BlockPool.touch``). Front = evicted first (least recently freed); the
    sentinel head and tail (block_id -1) remove every empty-list special case.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for prev, nxt in zip(chain, chain[1:]):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first_block = self.fake_free_list_head.next_free_block
        if first_block is self.fake_free_list_tail or first_block is None:
            assert self.num_free_blocks == 0
            raise ValueError("No free blocks available")
        self._unlink(first_block)
        return first_block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on a block that is not in the free queue: {block}")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        last_block = self.fake_free_list_tail.prev_free_block
        assert last_block is not None
        last_block.next_free_block = block
        block.prev_free_block = last_block
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, in their order (``blocks[0]`` is popped first)."""
        for block in reversed(blocks):
            first_block = self.fake_free_list_head.next_free_block
            assert first_block is not None
            self.fake_free_list_head.next_free_block = block
            block.prev_free_block = self.fake_free_list_head
            block.next_free_block = first_block
            first_block.prev_free_block = block
            self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head (evicted first) to tail: for step records and tests."""
        ret = []
        curr = self.fake_free_list_head.next_free_block
        while curr is not None and curr is not self.fake_free_list_tail:
            ret.append(curr)
            curr = curr.next_free_block
        return ret

    def _unlink(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is not None and block.next_free_block is not None
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1


@dataclass
class KVCacheBlocks:
    """What the KV cache manager hands the scheduler: ``blocks[group]`` is a list of blocks.

    minivllm always has exactly one group (full attention), so ``blocks`` has one entry.
    """
    blocks: tuple[list[KVCacheBlock], ...]

    def __add__(self, other: "KVCacheBlocks") -> "KVCacheBlocks":
        return KVCacheBlocks(tuple(
            list(itertools.chain(b1, b2)) for b1, b2 in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none: bool = False) -> Optional[tuple[list[int], ...]]:
        """Block ids per group, e.g. ``([1, 2, 3],)``; ``None`` when empty and ``allow_none``."""
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([blk.block_id for blk in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self.blocks) == 1, "Only one KV cache group is supported"
        return [blk.block_id for blk in self.blocks[0] if blk.block_hash is None]

    def new_empty(self) -> "KVCacheBlocks":
        return KVCacheBlocks(tuple([] for _ in range(len(self.blocks))))
