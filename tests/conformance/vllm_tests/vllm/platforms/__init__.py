"""vllm/platforms: minivllm's unit tests run on the CPU."""
from vllm import _missing


class _CpuPlatform:
    device_type = "cpu"
    device_name = "cpu"

    def is_cpu(self) -> bool:
        return True

    def is_cuda(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cuda_alike(self) -> bool:
        return False


current_platform = _CpuPlatform()
__getattr__ = _missing.module_getattr(__name__)
