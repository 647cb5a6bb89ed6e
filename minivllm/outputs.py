"""Outputs returned by ``LLM.generate()``, mirroring vllm/outputs.py and vllm/logprobs.py.

Logprobs come in vLLM's shapes: ``CompletionOutput.logprobs`` is one dict per output token and
``RequestOutput.prompt_logprobs`` one per prompt token (the first is ``None``: nothing predicts
it), each ``{token_id: Logprob(logprob, rank, decoded_token)}`` with the top k tokens (ranks 1..k)
and the sampled or prompt token itself, which may rank below k.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Logprob:
    """vLLM's ``Logprob``: ``rank`` 1 is the most likely token."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


PromptLogprobs = list[Optional[dict[int, Logprob]]]
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None     # "stop" | "length" | None while running
    stop_reason: Optional[int | str] = None  # the stop token id or stop string that ended it
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens this instance did not compute itself: local prefix-cache hits plus KV loaded
    # through a connector.
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # P/D: what the KV connector says about this request once it finished (a producer: what it
    # stored, to pass to the decode instance), as vLLM's field of the same name.
    kv_transfer_params: Optional[dict] = None
    prompt_logprobs: Optional[PromptLogprobs] = None
