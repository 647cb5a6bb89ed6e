"""Stop strings (``SamplingParams.stop``), the part of vllm/v1/core/sched/utils.py ``check_stop``
and of the front end's detokenizer that needs text: the scheduler checks them after each token
(``check_stop``), the engine cuts the output text at them (``LLMEngine.make_output``).

Loaded the first time a request with stop strings reaches them (a tokenizer is needed to see
text); the article's examples run without a tokenizer and never read this file.
"""
from __future__ import annotations

from typing import Callable

from minivllm.request import Request, RequestStatus


def check_stop_strings(request: Request, detokenize: Callable[[list[int]], str]) -> bool:
    """Whether the output text so far contains one of the request's stop strings (then the
    request is stopped, with that string as its ``stop_reason``)."""
    # vLLM checks stop strings in the front-end detokenizer; doing it here, token by token, lets an
    # accepted run of drafts end exactly where plain decoding would.
    text = detokenize(request.output_token_ids)
    for s in request.sampling_params.stop:
        if s in text:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = s
            return True
    return False


def truncate_at_stop(text: str, stop: str, include_stop_str_in_output: bool) -> str:
    """The output text up to the stop string (included with ``include_stop_str_in_output``)."""
    if stop not in text:
        return text
    cut = text.index(stop)
    return text[:cut + len(stop)] if include_stop_str_in_output else text[:cut]
