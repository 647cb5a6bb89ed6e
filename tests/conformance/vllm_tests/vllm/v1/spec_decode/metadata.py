"""vllm/v1/spec_decode/metadata.py -> minivllm/spec_decode/metadata.py (same fields, make_dummy)."""
from minivllm.spec_decode.metadata import SpecDecodeMetadata
from vllm import _missing

__getattr__ = _missing.module_getattr(__name__)
__all__ = ["SpecDecodeMetadata"]
