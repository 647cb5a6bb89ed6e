"""``ModelConfig``: the checkpoint, its dtype and context length, and what logprobs return; mirrors
vllm/config/model.py (``_get_and_verify_max_len`` included). The article's ``LLM(model=...)``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from minivllm.sampling_params import check_logprobs_mode

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    model: str
    dtype: str = "auto"
    max_model_len: Optional[int] = None   # resolved from the checkpoint when None
    skip_tokenizer_init: bool = False
    seed: int = 0
    # vLLM's: which numbers logprobs return ("raw_logprobs", "raw_logits", "processed_logprobs",
    # "processed_logits"), and the most a request may ask for (-1, the whole vocabulary, is allowed).
    logprobs_mode: str = "raw_logprobs"
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        check_logprobs_mode(self.logprobs_mode)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}.")

    def verify_with_hf_config(self, hf_config: Any) -> None:
        """vLLM's ``_get_and_verify_max_len``: the checkpoint's ``max_position_embeddings`` is
        the default and the limit of ``max_model_len``."""
        limit = int(getattr(hf_config, "max_position_embeddings", 2048))
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}.")
