"""minivllm: a small, runnable map of vLLM's V1 engine (speculative decoding, disaggregated P/D)."""
from minivllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name):
    # Imported lazily so that `import minivllm.config` does not pull in transformers and the model.
    if name == "LLM":
        from minivllm.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
