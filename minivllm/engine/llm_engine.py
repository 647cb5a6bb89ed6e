"""A step-at-a-time engine with a tokenizer in front, mirroring vllm/v1/engine/llm_engine.py.

``add_request()`` / ``step()`` / ``has_unfinished_requests()`` let a notebook or a debugger drive the
engine one step at a time; ``LLM.generate()`` is a loop over exactly these calls. Every article step
starts from ``step()`` (spec decode's verify step, a P/D consumer's request). A request with
``n > 1`` is fanned out into child requests here and their outputs folded back into the parent's
(vLLM's ``ParentRequest``, parallel_sampling.py).
"""
from __future__ import annotations

import copy

from typing import Any, Optional, TYPE_CHECKING, Union

from minivllm.config import VllmConfig
from minivllm.engine.core import EngineCore
from minivllm.engine.parallel_sampling import ParentRequest
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minivllm.engine.logprobs import LogprobsProcessor

PromptType = Union[str, dict]


class LLMEngine:
    def __init__(self, vllm_config: VllmConfig, tokenizer: Any = None,
                 extra_eos_token_ids: Optional[list[int]] = None) -> None:
        self.vllm_config = vllm_config
        self.tokenizer = tokenizer
        hf = vllm_config.hf_config
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        if eos is None:
            eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, list) else hf.eos_token_id
        self.eos_token_id: Optional[int] = eos
        self.extra_eos_token_ids = [t for t in (extra_eos_token_ids or []) if t != eos]
        self.engine_core = EngineCore(vllm_config, detokenize=self._detokenize if tokenizer else None)
        self._requests: dict[str, Request] = {}
        # req_id -> its logprobs so far (vLLM's OutputProcessor keeps one per request state).
        self._logprobs: dict[str, LogprobsProcessor] = {}
        # n > 1: child request id -> its parent (vLLM's ParentRequest).
        self._parents: dict[str, ParentRequest] = {}

    @property
    def scheduler(self):
        return self.engine_core.scheduler

    @property
    def tracer(self):
        return self.engine_core.tracer

    def _detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """A prompt's (text, token ids): ``{'prompt_token_ids': [...]}`` as given, text through the
        tokenizer (vLLM's ``InputProcessor``); ``ValueError`` for anything else, or for text
        without a tokenizer."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, dict):
            raise ValueError("a dict prompt must have the key 'prompt_token_ids'.")
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a str or {{'prompt_token_ids': [...]}}, got "
                             f"{type(prompt).__name__}.")
        if self.tokenizer is None:
            raise ValueError("skip_tokenizer_init=True: give prompts as {'prompt_token_ids': [...]}.")
        return prompt, self.tokenizer.encode(prompt)

    def validate_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """Tokenize and check one prompt (``ValueError`` naming the problem); nothing is queued."""
        text, token_ids = self.tokenize_prompt(prompt)
        max_model_len = self.vllm_config.model_config.max_model_len
        vocab = self.vllm_config.hf_config.vocab_size
        # Not empty, room left under max_model_len, every id in the vocabulary.
        if (not token_ids or len(token_ids) >= max_model_len
                or min(token_ids) < 0 or max(token_ids) >= vocab):
            if not token_ids:
                raise ValueError("prompt is empty: it must have at least one token.")
            if len(token_ids) >= max_model_len:
                raise ValueError(f"prompt has {len(token_ids)} tokens, which leaves no room under "
                                 f"max_model_len={max_model_len} (prompt tokens must be < "
                                 "max_model_len).")
            raise ValueError(f"prompt_token_ids must be in [0, {vocab}) for this model's "
                             "vocabulary.")
        return text, token_ids

    def add_request(self, request_id: str, prompt: PromptType,
                    params: Optional[SamplingParams] = None,
                    kv_transfer_params: Optional[dict] = None) -> Request:
        """``kv_transfer_params``: P/D state from the other instance (e.g. a producer's
        ``RequestOutput.kv_transfer_params``); vLLM carries it in
        ``SamplingParams.extra_args["kv_transfer_params"]``, and so does this (either way works)."""
        if params is not None and params.n > 1:
            return self._add_parent_request(request_id, prompt, params, kv_transfer_params)
        # A copy per request: the engine fills in per-request stop ids and max_tokens.
        params = SamplingParams() if params is None else copy.copy(params)
        if kv_transfer_params is not None:
            if not isinstance(kv_transfer_params, dict):
                raise ValueError(f"kv_transfer_params must be a dict, got {type(kv_transfer_params).__name__}.")
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": kv_transfer_params}
        params._all_stop_token_ids = set(params._all_stop_token_ids)
        text, token_ids = self.validate_prompt(prompt)
        self.verify_sampling_params(params)
        max_model_len = self.vllm_config.model_config.max_model_len
        if not params.ignore_eos and self.extra_eos_token_ids:
            params._all_stop_token_ids |= set(self.extra_eos_token_ids)
        if params.max_tokens is None:
            params.max_tokens = max_model_len - len(token_ids)
        request = self.scheduler.make_request(request_id, token_ids, params, self.eos_token_id,
                                              prompt=text)
        self._requests[request_id] = request
        if params.logprobs is not None or params.prompt_logprobs is not None:
            from minivllm.engine.logprobs import LogprobsProcessor
            self._logprobs[request_id] = LogprobsProcessor(params, self.tokenizer, token_ids)
        self.engine_core.add_request(request)
        return request

    def _add_parent_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                            kv_transfer_params: Optional[dict]) -> Request:
        """``add_request`` with ``n > 1`` (vLLM's fan-out in ``LLMEngine.add_request``): n child
        requests, each remembered with its ``ParentRequest``; returns the first."""
        self.validate_prompt(prompt)
        self.verify_sampling_params(params)
        parent = ParentRequest(request_id, params)
        children = []
        for i in range(parent.n):
            child_id, child_params = parent.get_child_info(i)
            self._parents[child_id] = parent
            children.append(self.add_request(child_id, prompt, child_params, kv_transfer_params))
        return children[0]

    def verify_sampling_params(self, params: SamplingParams) -> None:
        """The checks of ``params`` that need the model (vLLM's ``InputProcessor``): token ids
        inside the vocabulary, ``bad_words`` tokenised, ``logprobs`` within ``max_logprobs``."""
        params.verify_for_model(self.vllm_config.hf_config.vocab_size, self.tokenizer,
                                self.vllm_config.model_config.max_logprobs)

    def abort_request(self, request_ids: list[str]) -> None:
        """vLLM's ``abort_request``: finish the requests as ``FINISHED_ABORTED`` (the scheduler's
        ``finish_requests``) and forget them; a parent's id (``n > 1``) aborts its children."""
        request_ids = [c for r in request_ids for c in (
            [c for c, p in self._parents.items() if p.request_id == r] or [r])]
        for request_id in request_ids:
            self._parents.pop(request_id, None)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self._requests.pop(request_id, None)
            self._logprobs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        """Requests a caller still waits for (``LLM.generate`` loops on this, as vLLM's loops on
        its output processor)."""
        return self.scheduler.has_unfinished_requests()

    def has_requests(self) -> bool:
        """Whether ``step()`` has anything to do, vLLM's ``EngineCore`` busy-loop condition:
        unfinished requests, or finished ones whose blocks wait for a transfer (a server loop
        keeps stepping on this so a producer's held blocks are freed on ``finished_sending``)."""
        return self.scheduler.has_requests()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return a RequestOutput for every request that progressed."""
        results: dict[str, RequestOutput] = {}
        for request, new_token_ids in self.engine_core.step():
            req_id = request.request_id
            if req_id in self._logprobs:
                self._logprobs[req_id].update_from_output(request, new_token_ids)
            out = self.make_output(request)
            if req_id in self._parents:   # n > 1: the parent's output, all its children in it
                out = self._parent_output(request, out)
            results[out.request_id] = out
            if request.is_finished():
                self._requests.pop(req_id, None)
                self._logprobs.pop(req_id, None)
        return list(results.values())

    def _parent_output(self, request: Request, child_output: RequestOutput) -> RequestOutput:
        """A child that progressed -> its parent's output (every child's latest completion);
        once all children have finished, the engine forgets the parent."""
        parent = self._parents[request.request_id]
        out = parent.make_request_output(request.request_id, child_output)
        if request.is_finished() and out.finished:
            for child_id in parent.child_ids:
                self._parents.pop(child_id, None)
        return out

    def make_output(self, request: Request) -> RequestOutput:
        token_ids = list(request.output_token_ids)
        text = self._detokenize(token_ids) if self.tokenizer is not None else ""
        stop = request.stop_reason
        if isinstance(stop, str):   # stopped by a stop string: the text ends there
            from minivllm.core.sched.utils import truncate_at_stop
            text = truncate_at_stop(text, stop, request.sampling_params.include_stop_str_in_output)
        completion = CompletionOutput(0, text, token_ids, request.get_finished_reason(), stop)
        lp = self._logprobs.get(request.request_id)
        if lp is not None:
            completion.logprobs, completion.cumulative_logprob = lp.logprobs, lp.cumulative_logprob
        return RequestOutput(request.request_id, request.prompt, list(request.prompt_token_ids),
                             [completion], request.is_finished(),
                             num_cached_tokens=max(request.num_cached_tokens, 0),
                             kv_transfer_params=request.output_kv_transfer_params,
                             prompt_logprobs=None if lp is None else lp.prompt_logprobs)
