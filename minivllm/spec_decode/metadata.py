"""Where the drafts sit in a verify step: ``SpecDecodeMetadata``, by vLLM's path
(vllm/v1/spec_decode/metadata.py).

The class is defined beside ``SamplingMetadata`` in ``sample/metadata.py`` (its field table is
there), because the rejection sampler reads it and sampling sits below speculative decoding: the
drafters sample, so ``spec_decode`` imports ``sample``, never the other way round. The model runner
(``ModelRunner._calc_spec_decode_metadata``, article step 6) imports it from here, as vLLM's does.
"""
from minivllm.sample.metadata import SpecDecodeMetadata

__all__ = ["SpecDecodeMetadata"]
