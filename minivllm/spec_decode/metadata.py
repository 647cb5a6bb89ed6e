"""``SpecDecodeMetadata``, by vLLM's path (vllm/v1/spec_decode/metadata.py): where the drafts sit in
a verify step. The class and its field table are in ``sample/spec_decode_metadata.py``, below the
rejection sampler that reads it (sampling sits below speculative decoding). This module keeps
vLLM's import path for readers, tests and the drafters; the model runner
(``ModelRunner._calc_spec_decode_metadata``, article step 6) imports the class from there directly.
"""
from minivllm.sample.spec_decode_metadata import SpecDecodeMetadata

__all__ = ["SpecDecodeMetadata"]
