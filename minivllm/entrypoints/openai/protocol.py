"""OpenAI request bodies, checked field by field before anything is queued, mirroring
vllm/entrypoints/openai/{completion,chat_completion}/protocol.py (``CompletionRequest``,
``ChatCompletionRequest``) and vllm/entrypoints/serve/engine/protocol.py (``OpenAIBaseModel``).

- Fields vLLM adds to OpenAI's (``top_k``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``,
  ``include_stop_str_in_output``, ``kv_transfer_params``) are accepted at the top level of the body,
  as vLLM does (the ``openai`` client sends them through ``extra_body``).
- Unknown fields are accepted and ignored, as in vLLM (its ``OpenAIBaseModel`` has
  ``extra="allow"`` and only logs them): OpenAI clients send fields this server has no use for.
- Numeric ranges are vLLM's ``SamplingParams._verify_args`` ranges (temperature finite in [0, 2],
  top_p in (0, 1], top_k >= -1, max_tokens >= 1, min_tokens >= 0, presence and frequency penalties
  in [-2, 2], repetition_penalty > 0, min_p in [0, 1], logit_bias values in [-100, 100] as OpenAI,
  logprobs / top_logprobs at most 20) and its 64-bit ``seed``. They are declared on the fields, so
  ``/openapi.json`` states them and a fuzzer can read them.
- ``logprobs`` (completions: top k per token; chat: ``logprobs`` + ``top_logprobs``) come back in
  OpenAI's shapes (serving.py), streamed too; ``n > 1`` gives n choices (streamed: by ``index``).
- A completion ``prompt`` may be a list of strings (or of token-id lists): one choice per prompt
  (not streamed: a list of more than one is a 400 with ``stream``). ``echo`` puts the prompt (token
  ids decoded) before the completion's text (and, with ``logprobs``, the prompt's logprobs before
  its tokens', the first ``null``), as vLLM does; streamed, in each choice's first chunk.
- vLLM's ``prompt_logprobs`` come back on each choice as ``prompt_logprobs``: per prompt token
  ``null`` (the first) or ``{token_id: {"logprob", "rank", "decoded_token"}}``.
- A chat message has a non-empty ``role`` (which roles are allowed is the chat template's business:
  its errors are 400s too, see serving.py) and ``content``: a string, or OpenAI's list of content
  parts of which only ``{"type": "text"}`` is supported; parts are joined with newlines, as vLLM does
  for a template that expects string content.

A body that fails these checks is HTTP 400 with OpenAI's error JSON (``ErrorResponse``) whose
``param`` names the field.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from minivllm.sampling_params import SamplingParams

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
# logit_bias keys: JSON keys are strings; a token id is at most six digits for any vocabulary here.
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,6}$")]
Float = Annotated[float, Field(allow_inf_nan=False)]


class OpenAIBaseModel(BaseModel):
    # vLLM accepts and ignores unknown fields; so does this server.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: str = Field(min_length=1, description="Passed to the chat template, which may refuse it.")
    content: Union[str, Annotated[list[TextContentPart], Field(min_length=1)]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class _SamplingFields(OpenAIBaseModel):
    model: Optional[str] = None
    temperature: Optional[Annotated[Float, Field(ge=0.0, le=2.0)]] = None
    top_p: Optional[Annotated[Float, Field(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Field(ge=-1, le=INT64_MAX)]] = None
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    seed: Optional[Int64] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[TokenId]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: Annotated[int, Field(ge=1, le=16384)] = 1
    # OpenAI's penalties and bias, vLLM's repetition_penalty and min_p (SamplingParams' ranges).
    presence_penalty: Optional[Annotated[Float, Field(ge=-2.0, le=2.0)]] = None
    frequency_penalty: Optional[Annotated[Float, Field(ge=-2.0, le=2.0)]] = None
    repetition_penalty: Optional[Annotated[Float, Field(gt=0.0, le=1e9)]] = None
    min_p: Optional[Annotated[Float, Field(ge=0.0, le=1.0)]] = None
    logit_bias: Optional[dict[TokenIdKey, Annotated[Float, Field(ge=-100.0, le=100.0)]]] = None
    # vLLM's extras.
    bad_words: Optional[list[Annotated[str, Field(min_length=1)]]] = None
    allowed_token_ids: Optional[Annotated[list[TokenId], Field(min_length=1)]] = None
    prompt_logprobs: Optional[Annotated[int, Field(ge=-1, le=20)]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    kv_transfer_params: Optional[dict[str, Any]] = None

    def check_supported(self) -> None:
        """``ValueError`` (HTTP 400) for what this server does not do, before anything is queued."""
        self.num_logprobs()   # top_logprobs without logprobs is a 400

    def num_logprobs(self) -> Optional[int]:
        """SamplingParams.logprobs: top-k per output token, or None."""
        return None

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        extra = ({"kv_transfer_params": self.kv_transfer_params}
                 if self.kv_transfer_params is not None else None)
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, extra_args=extra,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0, logit_bias=self.logit_bias, logprobs=self.num_logprobs(),
            n=self.n, bad_words=self.bad_words, allowed_token_ids=self.allowed_token_ids,
            prompt_logprobs=self.num_prompt_logprobs())

    def num_prompt_logprobs(self) -> Optional[int]:
        return self.prompt_logprobs


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    max_tokens: Optional[Annotated[int, Field(ge=1, le=INT64_MAX)]] = 16   # OpenAI's default
    echo: bool = False
    logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None

    def num_logprobs(self) -> Optional[int]:
        return self.logprobs

    def num_prompt_logprobs(self) -> Optional[int]:
        """``echo`` with ``logprobs``: the prompt's logprobs too (they are echoed with it)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def get_prompts(self) -> list[Union[str, dict]]:
        """The prompts, one choice each (as vLLM): a string, token ids, or a list of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [{"prompt_token_ids": p}]
        if p and all(isinstance(x, str) for x in p):
            if self.stream and len(p) > 1:
                raise ValueError("prompt: a list of prompts cannot be streamed by this server.")
            return list(p)
        if p and all(isinstance(x, list) for x in p):
            if self.stream and len(p) > 1:
                raise ValueError("prompt: a list of prompts cannot be streamed by this server.")
            return [{"prompt_token_ids": x} for x in p]
        raise ValueError("prompt: a string, a list of token ids, or a non-empty list of either.")


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # None: up to max_model_len - prompt, as in vLLM.
    max_tokens: Optional[Annotated[int, Field(ge=1, le=INT64_MAX)]] = None
    max_completion_tokens: Optional[Annotated[int, Field(ge=1, le=INT64_MAX)]] = None
    add_generation_prompt: bool = True
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=20)]] = None

    def num_logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true.")
        return (self.top_logprobs or 0) if self.logprobs else None

    def get_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """What the chat template sees: ``role`` and string ``content`` only."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ---------------------------------------------------------------------- responses (for the spec)
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error JSON, vLLM's ``ErrorResponse``."""
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class _ChoiceBase(BaseModel):
    index: int
    logprobs: Optional[dict[str, Any]] = None
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None
    finish_reason: Optional[Literal["stop", "length", "abort"]]
    stop_reason: Optional[Union[int, str]] = None


class CompletionChoice(_ChoiceBase):
    text: str


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(_ChoiceBase):
    message: ChatMessageOut


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    kv_transfer_params: Optional[dict[str, Any]] = None


class ChatCompletionResponse(CompletionResponse):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


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
