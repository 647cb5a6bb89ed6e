"""Stop checks, mirroring vllm/v1/core/sched/utils.py ``check_stop`` (article spec step 8: repeat
until a stop condition is met), with the stop strings of vllm/v1/engine/detokenizer.py beside it:
the scheduler checks them after each token (``check_stop``), the engine cuts the output text at
them (``truncate_at_stop``)."""
from __future__ import annotations

from typing import Callable, Optional

from minivllm.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int,
               detokenize: Optional[Callable[[list[int]], str]] = None) -> bool:
    """After one appended token: EOS, stop token ids, length, then (from ``min_tokens`` on) stop
    strings; vLLM 0.32's order. EOS and stop ids cannot appear before ``min_tokens``: the sampler
    masks them (sample/logits_processor.py). Sets status.
    A free function, not a ``Scheduler`` method: vLLM keeps it free."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if not params.ignore_eos and last == request.eos_token_id:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params._all_stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    if request.num_tokens >= max_model_len or request.num_output_tokens >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.num_output_tokens < params.min_tokens:
        return False
    if params.stop and detokenize is not None:   # text, so a tokenizer
        # vLLM checks stop strings in the front-end detokenizer; doing it here, token by token,
        # lets an accepted run of drafts end exactly where plain decoding would.
        text = detokenize(request.output_token_ids)
        for stop_str in params.stop:
            if stop_str in text:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = stop_str
                return True
    return False


def truncate_at_stop(text: str, stop: str, include_stop_str_in_output: bool) -> str:
    """The output text up to the stop string (included with ``include_stop_str_in_output``)."""
    if stop not in text:
        return text
    cut = text.index(stop)
    return text[:cut + len(stop)] if include_stop_str_in_output else text[:cut]
