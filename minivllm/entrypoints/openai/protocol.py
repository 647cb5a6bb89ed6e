"""OpenAI request bodies and their translation to ``SamplingParams``, mirroring
vllm/entrypoints/openai/protocol.py (``CompletionRequest``, ``ChatCompletionRequest``,
``ErrorResponse``). Fields vLLM adds to OpenAI's (``top_k``, ``min_tokens``, ``stop_token_ids``,
``ignore_eos``, ``include_stop_str_in_output``, ``kv_transfer_params``) are accepted at the top level
of the body, as vLLM does (the ``openai`` client sends them through ``extra_body``).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict

from minivllm.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    # Unknown fields are ignored, as OpenAI clients send some this server has no use for.
    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_tokens: int = 0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Any] = None
    kv_transfer_params: Optional[dict] = None

    def check_supported(self) -> None:
        """``ValueError`` (HTTP 400) for what this server does not do, before anything is queued."""
        if self.n != 1:
            raise ValueError(f"n: only n=1 is supported, got {self.n}.")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs: not supported by this server.")

    def to_sampling_params(self, max_tokens: Optional[int]) -> SamplingParams:
        extra = ({"kv_transfer_params": self.kv_transfer_params}
                 if self.kv_transfer_params is not None else None)
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, extra_args=extra)


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16          # OpenAI's default for /v1/completions
    echo: bool = False

    def get_prompt(self) -> Union[str, dict]:
        """One prompt: a string or token ids (``{"prompt_token_ids": [...]}``)."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return p
        if isinstance(p, list) and all(isinstance(t, int) for t in p):
            return {"prompt_token_ids": p}
        raise ValueError("prompt: give one prompt per request (a string or a list of token ids).")

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ValueError("echo: not supported by this server.")


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: Optional[int] = None        # None: up to max_model_len, as in vLLM
    max_completion_tokens: Optional[int] = None
    add_generation_prompt: bool = True

    def get_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def random_uuid() -> str:
    return uuid.uuid4().hex


def error_body(message: str, err_type: str = "BadRequestError", code: int = 400,
               param: Optional[str] = None) -> dict:
    """OpenAI's error JSON (vLLM's ``ErrorResponse``)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def usage_body(num_prompt: int, num_generated: int, num_cached: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_generated,
            "total_tokens": num_prompt + num_generated,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


def now() -> int:
    return int(time.time())
