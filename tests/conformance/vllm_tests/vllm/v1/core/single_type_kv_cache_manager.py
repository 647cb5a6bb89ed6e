"""vllm/v1/core/single_type_kv_cache_manager.py: minivllm has one manager type (full attention,
folded into KVCacheManager), so there is no spec registry to fill."""
from vllm import _missing


def register_all_kvcache_specs(vllm_config=None) -> None:
    pass


__getattr__ = _missing.module_getattr(__name__)
