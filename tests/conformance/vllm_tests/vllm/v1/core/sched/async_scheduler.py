"""vllm/v1/core/sched/async_scheduler.py -> minivllm/core/sched/async_scheduler.py."""
from vllm import _missing
from vllm.v1.core.sched.scheduler import AsyncScheduler

__getattr__ = _missing.module_getattr(__name__)
__all__ = ["AsyncScheduler"]
