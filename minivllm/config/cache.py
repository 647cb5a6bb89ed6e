"""``CacheConfig``: the paged KV cache's block size, prefix caching and its size in blocks; mirrors
vllm/config/cache.py. The blocks the article's ``allocate_slots`` hands out (``spec.4``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: Optional[int] = None
    # Memory for the KV cache when num_gpu_blocks_override is not given.
    kv_cache_memory_bytes: Optional[int] = None
    num_gpu_blocks: Optional[int] = None      # resolved by the worker

    def __post_init__(self) -> None:
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
            raise ValueError(
                f"block_size must be a positive power of two (1, 2, 4, ..., 256), got {bs!r}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2 (block 0 is the reserved "
                             f"null block), got {self.num_gpu_blocks_override}.")
