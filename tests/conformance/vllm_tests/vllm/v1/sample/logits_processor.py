"""vllm/v1/sample/logits_processor: the built-in processors only (min_tokens, logit bias, min_p
are SamplingMetadata fields in minivllm); custom ones are not in minivllm."""
from vllm import _missing


class LogitsProcessors:
    def __init__(self, logitsprocs=None):
        self.custom = list(logitsprocs or [])


__getattr__ = _missing.module_getattr(__name__)
