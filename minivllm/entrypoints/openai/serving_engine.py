"""The request side of the two generation endpoints, mirroring vllm/entrypoints/openai/
serving_engine.py: every check a request must pass before it is queued (the model name, the chat
template, the prompt's tokens, ``max_tokens`` against the room left in the context, the sampling
parameters), each failure a 400 naming the field at fault. serving.py answers the requests.
"""
from __future__ import annotations

from typing import Optional, Union

import jinja2

from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.openai.errors import error_response
from minivllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


class BadRequest(ValueError):
    """A request that cannot be served as given: HTTP 400 naming ``param``, the field at fault."""

    def __init__(self, param: Optional[str], message: str) -> None:
        super().__init__(message)
        self.param = param


class OpenAIServingBase:
    """The request side of both endpoints (vLLM's ``OpenAIServing`` in serving_engine.py): the
    model name, the chat template, the tokens, the room left in the context and the
    ``SamplingParams``, all checked before anything is queued."""

    def __init__(self, async_llm: AsyncLLM, served_model_name: str) -> None:
        self.async_llm = async_llm
        self.model_name = served_model_name
        self.engine = async_llm.engine
        self.max_model_len = self.engine.vllm_config.model_config.max_model_len

    # ------------------------------------------------------------------ checks
    def _render_chat(self, body: ChatCompletionRequest) -> str:
        """The chat template applied to the messages; whatever the template or the tokenizer
        refuses (a role it does not know, an order it forbids, text it cannot encode) is a 400."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise BadRequest("messages", "messages: this model has no chat template; "
                                         "use /v1/completions.")
        try:
            prompt = tokenizer.apply_chat_template(
                body.template_messages(), add_generation_prompt=body.add_generation_prompt,
                tokenize=False)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
            raise BadRequest("messages", f"messages: the chat template refused them: "
                                         f"{type(e).__name__}: {e}") from e
        if not isinstance(prompt, str):
            raise BadRequest("messages", "messages: the chat template did not render to text.")
        return prompt

    def _tokenize(self, prompt: Union[str, dict], param: str) -> list[int]:
        try:
            _, token_ids = self.engine.validate_prompt(prompt)
        except TypeError as e:                  # what tokenizers raise on lone surrogates
            raise BadRequest(param, f"{param}: the text cannot be tokenized (it must be valid "
                                    f"Unicode, without lone surrogates): {e}") from e
        except ValueError as e:
            raise BadRequest(param, f"{param}: {e}") from e
        return token_ids

    def _prepare(self, body: Union[CompletionRequest, ChatCompletionRequest]):
        """Everything that can make a request invalid, checked before it is queued. Returns
        ([(prompt, SamplingParams), ...], None), one pair per prompt, or (None, an error response)."""
        if body.model is not None and body.model != self.model_name:
            return None, error_response(f"The model `{body.model}` does not exist.", 404, "model")
        try:
            try:
                body.check_supported()
            except ValueError as e:
                raise BadRequest(str(e).split(":")[0], str(e)) from e
            if isinstance(body, ChatCompletionRequest):
                prompts, param = [self._render_chat(body)], "messages"
            else:
                try:
                    prompts = body.get_prompts()
                except ValueError as e:
                    raise BadRequest("prompt", str(e)) from e
                param = "prompt"
            prepared = [self._prepare_one(body, prompt, param) for prompt in prompts]
        except BadRequest as e:
            return None, error_response(str(e), 400, e.param)
        return prepared, None

    def _prepare_one(self, body: Union[CompletionRequest, ChatCompletionRequest],
                     prompt: Union[str, dict], param: str):
        """One prompt's (engine prompt, SamplingParams); a ``BadRequest`` if it cannot be served."""
        max_tokens = body.get_max_tokens() if isinstance(body, ChatCompletionRequest) \
            else body.max_tokens
        token_ids = self._tokenize(prompt, param)
        room = self.max_model_len - len(token_ids)
        if max_tokens is None:              # vLLM's default: whatever room is left
            max_tokens = room
        elif max_tokens > room:             # vLLM refuses; it never clamps silently
            raise BadRequest("max_tokens",
                f"max_tokens: this model's maximum context length is {self.max_model_len} "
                f"tokens. However, you requested {len(token_ids) + max_tokens} tokens "
                f"({len(token_ids)} in the {param}, {max_tokens} for the completion).")
        try:
            params = body.to_sampling_params(max_tokens)
            # The checks that need the model: token ids in the vocabulary, logprobs <= max.
            self.engine.verify_sampling_params(params)
        except ValueError as e:             # SamplingParams' own checks (min_tokens, stop)
            field = str(e).split(" ")[0].rstrip(":")
            if field == "token_id(s)":
                field = "logit_bias"
            if field not in type(body).model_fields:
                raise BadRequest(None, str(e)) from e
            raise BadRequest(field, f"{field}: {e}") from e
        # Token ids from here on: the engine does not tokenize the same text twice.
        return ({"prompt": prompt if isinstance(prompt, str) else None,
                 "prompt_token_ids": token_ids}, params)
