"""vllm/v1/metrics/stats.py -> minivllm's PrefixCacheStats (core/kv_cache_manager.py)."""
from minivllm.core.kv_cache_manager import PrefixCacheStats
from vllm import _missing

__getattr__ = _missing.module_getattr(__name__)
__all__ = ["PrefixCacheStats"]
