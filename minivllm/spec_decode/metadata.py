"""``SpecDecodeMetadata`` at vLLM's path (vllm/v1/spec_decode/metadata.py): where the drafts sit in
a verify step (article steps 6 and 7). The class and its field table are in
``sample/spec_decode_metadata.py``, below the rejection sampler that reads it: sampling sits below
speculative decoding in the layers, since the drafters sample.
"""
from minivllm.sample.spec_decode_metadata import SpecDecodeMetadata

__all__ = ["SpecDecodeMetadata"]
