"""vllm/v1/core/kv_cache_utils.py -> minivllm/core/kv_cache_utils.py.

minivllm has one KV-cache group, so a block's hash is vLLM's hash with group id 0: no 4-byte
group suffix (``make_block_hash_with_group_id(h, 0)`` is ``h``). Its hash is sha256 over the
packed token ids with a fixed ``NONE_HASH``; vLLM's choice of hash function (the ``hash_fn``
arguments) does not exist in minivllm and is not passed on."""
from __future__ import annotations

from minivllm.core import kv_cache_utils as _mini
from minivllm.core.kv_cache_utils import (BlockHash, FreeKVCacheBlockQueue, KVCacheBlock,
                                          KVCacheBlocks)
from vllm import _missing

BlockHashWithGroupId = BlockHash


def hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys=None):
    return _mini.hash_block_tokens(parent_block_hash, list(curr_block_token_ids), extra_keys)


def init_none_hash(hash_fn) -> None:
    """minivllm's NONE_HASH is fixed (reproducible traces); nothing to initialise."""


def get_request_block_hasher(block_size: int, caching_hash_fn=None):
    return _mini.get_request_block_hasher(block_size)


def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
    """vLLM also returns the next multimodal index; minivllm has no multimodal inputs."""
    return _mini.generate_block_hash_extra_keys(request, start_token_idx), start_mm_idx


def make_block_hash_with_group_id(block_hash, group_id: int):
    if group_id != 0:
        _missing._raise("vllm.v1.core.kv_cache_utils.make_block_hash_with_group_id (groups > 0)")
    return block_hash


def get_block_hash(key):
    return key


def get_group_id(key) -> int:
    return 0


def __getattr__(name):
    if hasattr(_mini, name) and not name.startswith("_"):
        return getattr(_mini, name)
    return _missing.missing(f"{__name__}.{name}")


__all__ = ["BlockHash", "FreeKVCacheBlockQueue", "KVCacheBlock", "KVCacheBlocks"]
