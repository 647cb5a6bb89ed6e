"""vllm/v1/core/sched/utils.py -> minivllm/core/sched/utils.py (check_stop)."""
from minivllm.core.sched.utils import check_stop as _check_stop
from vllm import _missing


def check_stop(request, max_model_len: int, pooler_output=None) -> bool:
    if pooler_output is not None:
        _missing._raise("vllm.v1.core.sched.utils.check_stop(pooler_output=...)")
    return _check_stop(request, max_model_len)


__getattr__ = _missing.module_getattr(__name__)
