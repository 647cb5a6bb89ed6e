"""``SpecDecodeMetadata``, by vLLM's path (vllm/v1/spec_decode/metadata.py): where the drafts sit in
a verify step. The class and its field table are in ``sample/spec_decode_metadata.py``, below the
rejection sampler that reads it (sampling sits below speculative decoding); the model runner
(``ModelRunner._calc_spec_decode_metadata``, article step 6) imports it from here, as vLLM's does.
"""
from minivllm.sample.spec_decode_metadata import SpecDecodeMetadata

__all__ = ["SpecDecodeMetadata"]
