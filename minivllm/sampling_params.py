"""Sampling parameters, mirroring vllm/sampling_params.py.

Defaults are vLLM's: ``temperature=1.0``, ``top_p=1.0``, ``top_k=0`` (off), ``max_tokens=16``.
``temperature=0`` means greedy. Every check runs in ``__post_init__`` so a bad value fails before the
engine does any work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

_SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    extra_args: Optional[dict] = None
    # Filled in by the engine from the tokenizer / model config; not user-facing.
    _all_stop_token_ids: set = field(default_factory=set, repr=False)
    # The model's EOS id (set by Request); min_tokens masks it too, as vLLM does.
    _eos_token_id: Optional[int] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.temperature < 0:
            raise ValueError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables top-k), got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}).")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty.")
        if self.temperature < _SAMPLING_EPS:
            # Greedy: top-p / top-k are irrelevant; normalise them like vLLM does.
            self.top_p, self.top_k = 1.0, 0
        self._all_stop_token_ids = set(self.stop_token_ids)

    @property
    def all_stop_token_ids(self) -> set[int]:
        """What ``min_tokens`` masks (vLLM's ``SamplingParams.all_stop_token_ids``): the stop token
        ids, the extra EOS ids and the EOS id (masked even with ``ignore_eos``, as in vLLM)."""
        eos = set() if self._eos_token_id is None else {self._eos_token_id}
        return self._all_stop_token_ids | eos

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS
