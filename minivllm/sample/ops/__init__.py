"""The sampler's logits operations, mirroring vllm/v1/sample/ops/ (``penalties.py``, ``bad_words.py``,
``logprobs.py``) and the built-in logits processors of vllm/v1/sample/logits_processor/builtin.py
(``builtin.py`` here); ``SamplingMetadata._fill_logits_processor_fields`` fills their
``SamplingMetadata`` fields."""
