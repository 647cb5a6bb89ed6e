"""vllm/v1/kv_cache_interface.py: the KV-cache layout the scheduler is built for. minivllm has one
full-attention group (``FullAttentionSpec``); sliding window, Mamba, MLA and the other specs are
not in minivllm. These carry data only; ``Scheduler`` and ``KVCacheManager`` read them."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from vllm import _missing


@dataclass(frozen=True)
class FullAttentionSpec:
    """vLLM's fields, as data. minivllm's cache is plain full attention: the scheduler and the
    manager accept a spec only if every field past ``dtype`` keeps its default."""
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any
    dcp_sharded: bool = True
    max_tp_shards: Any = None
    head_size_v: Any = None
    kv_quant_mode: Any = None
    page_size_padded: Any = None
    num_head_slots: Any = None
    state_content_bytes: Any = None
    tokens_per_state: Any = 1
    sliding_window: Any = None
    attention_chunk_size: Any = None
    non_causal: bool = False
    block_stride_alignment: Any = None

    def is_plain(self) -> bool:
        return all(getattr(self, f.name) == f.default for f in fields(self)
                   if f.name not in ("block_size", "num_kv_heads", "head_size", "dtype",
                                     "head_size_v", "dcp_sharded"))


@dataclass
class KVCacheTensor:
    size: int
    shared_by: list[str]


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: Any
    is_eagle_group: bool = False
    host_resident: bool = False
    enable_kv_transfer: bool = True
    role: Any = None


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list = field(default_factory=list)
    kv_cache_groups: list = field(default_factory=list)
    prefix_cache_retention_interval: Any = None
    kv_cache_layout: Any = None
    hash_block_size: Any = None
    cache_hit_alignment_tokens: Any = None
    hisparse_host_num_blocks: Any = None
    hisparse_host_block_stride: Any = None
    hisparse_shared_host_pool: bool = False

    def single_full_attention_block_size(self) -> int:
        """minivllm's one group: plain full attention, else NotInMinivllm."""
        groups = self.kv_cache_groups
        if (len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec)
                or not groups[0].kv_cache_spec.is_plain()):
            _missing._raise("vllm.v1.kv_cache_interface: KV-cache groups other than one plain "
                            "full-attention group")
        extras = (self.prefix_cache_retention_interval, self.hash_block_size,
                  self.cache_hit_alignment_tokens, self.hisparse_host_num_blocks)
        if any(x is not None for x in extras):
            _missing._raise("vllm.v1.kv_cache_interface.KVCacheConfig (retention, hisparse, ...)")
        return groups[0].kv_cache_spec.block_size


__getattr__ = _missing.module_getattr(__name__)
