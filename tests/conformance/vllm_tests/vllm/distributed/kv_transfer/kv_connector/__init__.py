from vllm import _missing

__getattr__ = _missing.module_getattr(__name__)
