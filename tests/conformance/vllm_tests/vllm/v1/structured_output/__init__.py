"""vllm/v1/structured_output: minivllm has no structured output. The test helpers always build a
manager; one with no grammar changes nothing, so the scheduler gets none."""
from vllm import _missing


def StructuredOutputManager(vllm_config=None):
    return None


__getattr__ = _missing.module_getattr(__name__)
