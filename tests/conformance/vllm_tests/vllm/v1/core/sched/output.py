"""vllm/v1/core/sched/output.py -> minivllm/core/sched/output.py."""
from minivllm.core.sched import output as _mini
from minivllm.core.sched.output import NewRequestData, SchedulerOutput
from vllm import _missing


class CachedRequestData(_mini.CachedRequestData):
    @classmethod
    def make_empty(cls) -> "CachedRequestData":
        return cls()


__getattr__ = _missing.module_getattr(__name__)
__all__ = ["CachedRequestData", "NewRequestData", "SchedulerOutput"]
