"""The two generation endpoints, mirroring vllm/entrypoints/openai/serving_completion.py and
serving_chat.py: check the body, build ``SamplingParams``, run ``AsyncLLM.generate`` and turn its
cumulative ``RequestOutput`` objects into OpenAI's response or its server-sent-event chunks.

Streaming holds back text that could still turn out to be the start of a stop string (it would be
cut from the final text) and a trailing incomplete UTF-8 character (decoded as U+FFFD), so that the
concatenated deltas always equal the non-streamed text. With ``echo``, each choice's first chunk
starts with the prompt (and its logprobs), as vLLM's ``completion_stream_generator`` sends it.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Optional

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.engine.async_llm import (AsyncLLM, DuplicateRequestError, EngineDeadError,
                                       EngineOverloadedError)
from minivllm.entrypoints.openai.errors import error_response
from minivllm.entrypoints.openai.logprobs import (chat_logprobs, completion_logprobs,
                                                  prompt_logprobs_body)
from minivllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  error_body, now, random_uuid, usage_body)
from minivllm.entrypoints.openai.serving_engine import OpenAIServingBase
from minivllm.outputs import RequestOutput


class OpenAIServing(OpenAIServingBase):
    """The response side: ``AsyncLLM.generate``, then OpenAI's body or its stream of chunks."""

    # ------------------------------------------------------------------ entry points
    async def create_completion(self, body: CompletionRequest, raw: HTTPRequest):
        return await self._create(body, raw, chat=False)

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: HTTPRequest):
        return await self._create(body, raw, chat=True)

    async def _create(self, body, raw: HTTPRequest, chat: bool):
        prepared, err = self._prepare(body)
        if err is not None:
            return err
        base_id = raw.headers.get("X-Request-Id") or random_uuid()
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{base_id}"
        headers = {"X-Request-Id": base_id}
        if len(prepared) > 1:
            return await self._create_batch(request_id, prepared, raw, headers,
                                            echo=getattr(body, "echo", False))
        prompt, params = prepared[0]
        gen = self.async_llm.generate(request_id, prompt, params)
        if body.stream:
            try:
                first = await gen.__anext__()     # surfaces 503 before the stream starts
            except (EngineOverloadedError, EngineDeadError, ValueError) as e:
                return _engine_error(e)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                self._stream(request_id, first, gen, params.stop, chat, include_usage,
                             echo=getattr(body, "echo", False)),
                media_type="text/event-stream", headers=headers)
        try:
            final = await _collect_unless_disconnected(gen, raw)
        except (EngineOverloadedError, EngineDeadError, ValueError) as e:
            return _engine_error(e)
        if final is None:                      # the client went away; the request was aborted
            return error_response("client disconnected", 499)
        if final.outputs[0].finish_reason == "error":   # kv_load_failure_policy="fail"
            return error_response("the request's KV cache failed to load", 500)
        return JSONResponse(self._full_response(request_id, final, chat,
                                                echo=getattr(body, "echo", False)),
                            headers=headers)

    async def _create_batch(self, request_id: str, prepared: list, raw: HTTPRequest,
                            headers: dict, echo: bool = False) -> Response:
        """A completion with a list of prompts: one request each (``{request_id}-{i}``), run
        together; the response has one choice per prompt, in order, and the summed usage."""
        gens = [self.async_llm.generate(f"{request_id}-{i}", prompt, params)
                for i, (prompt, params) in enumerate(prepared)]
        try:
            finals = await asyncio.gather(*[_collect_unless_disconnected(g, raw) for g in gens])
        except (EngineOverloadedError, EngineDeadError, ValueError) as e:
            for g in gens:
                await g.aclose()
            return _engine_error(e)
        if any(f is None for f in finals):
            return error_response("client disconnected", 499)
        bodies = [self._full_response(request_id, f, chat=False, first_index=i * len(f.outputs),
                                      echo=echo) for i, f in enumerate(finals)]
        body = bodies[0]
        body["choices"] = [c for b in bodies for c in b["choices"]]
        usages = [b["usage"] for b in bodies]
        body["usage"] = usage_body(sum(u["prompt_tokens"] for u in usages),
                                   sum(u["completion_tokens"] for u in usages),
                                   sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages))
        return JSONResponse(body, headers=headers)

    # ------------------------------------------------------------------ responses
    def _full_response(self, request_id: str, out: RequestOutput, chat: bool,
                       first_index: int = 0, echo: bool = False) -> dict:
        choices = []
        for c in out.outputs:   # n > 1: one choice per sample
            choice: dict[str, Any] = {"index": first_index + c.index, "logprobs": None,
                                      "finish_reason": c.finish_reason,
                                      "stop_reason": c.stop_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": c.text}
            else:
                choice["text"] = self._prompt_text(out) + c.text if echo else c.text
            if c.logprobs is not None:
                choice["logprobs"] = (chat_logprobs(c, self._top_k(c)) if chat
                                      else completion_logprobs(
                                          c, out.prompt_logprobs if echo else None,
                                          out.prompt_token_ids, self._decode_one))
            if out.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs)
            choices.append(choice)
        return {"id": request_id, "object": "chat.completion" if chat else "text_completion",
                "created": now(), "model": self.model_name, "choices": choices,
                "usage": usage_body(len(out.prompt_token_ids),
                                    sum(len(c.token_ids) for c in out.outputs),
                                    out.num_cached_tokens),
                "kv_transfer_params": getattr(out, "kv_transfer_params", None)}

    def _prompt_text(self, out: RequestOutput) -> str:
        """The prompt as ``echo`` returns it: a prompt given as token ids is decoded, as vLLM's
        ``_normalize_prompt_tokens_to_input`` does, so echo never drops it."""
        if out.prompt is not None:
            return out.prompt
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(out.prompt_token_ids) if tokenizer else ""

    def _decode_one(self, token_id: int) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else ""

    def _top_k(self, c: Any) -> int:
        """How many alternatives each position has (the ranks 1..k present)."""
        first = c.logprobs[0] if c.logprobs else {}
        return sum(1 for lp in first.values() if lp.rank is not None and lp.rank <= len(first))

    def _stream_logprobs(self, c: Any, chat: bool, start: int,
                         echo_of: Optional[RequestOutput] = None) -> Optional[dict]:
        """The logprobs of positions ``start:`` of completion ``c``, in the response's shape: each
        chunk carries those of the tokens that arrived since the last, so together they are the
        non-streamed response's. With ``echo_of`` (the request's output, for ``echo``) the
        positions are the prompt's then the completion's, as in the non-streamed body, so the
        text offsets run on from the prompt's."""
        if c.logprobs is None:
            return None
        if chat:
            if start >= len(c.logprobs):
                return None
            return {"content": chat_logprobs(c, self._top_k(c))["content"][start:]}
        if echo_of is None:
            full = completion_logprobs(c)
        else:
            full = completion_logprobs(c, echo_of.prompt_logprobs, echo_of.prompt_token_ids,
                                       self._decode_one)
        if start >= len(full["tokens"]):
            return None
        return {k: v[start:] for k, v in full.items()}

    def _chunk(self, request_id: str, chat: bool, delta: Optional[str],
               finish_reason: Optional[str] = None, role: bool = False,
               logprobs: Optional[dict] = None, index: int = 0) -> str:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
        if chat:
            choice["delta"] = ({"role": "assistant", "content": ""} if role
                               else ({"content": delta} if delta else {}))
        else:
            choice["text"] = delta or ""
        chunk = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                 "created": now(), "model": self.model_name, "choices": [choice]}
        return f"data: {json.dumps(chunk)}\n\n"

    async def _stream(self, request_id: str, first: RequestOutput,
                      gen: AsyncIterator[RequestOutput], stop: list[str], chat: bool,
                      include_usage: bool, echo: bool = False) -> AsyncIterator[str]:
        """Server-sent events; with ``n > 1`` each choice's chunks carry its ``index``.

        ``echo``: the prompt goes in front of each choice's first text (or finish) chunk, as vLLM
        sends it with the first output: the prompt's logprobs are only complete once the prefill
        is, which the first sampled token proves. ``lp_sent`` then counts the prompt's positions
        too."""
        holdback = max((len(s) for s in stop), default=1) - 1
        n = len(first.outputs)
        sent, lp_sent, done = [0] * n, [0] * n, [False] * n
        echoed = [not echo] * n
        out = first
        try:
            if chat:
                for i in range(n):
                    yield self._chunk(request_id, chat, None, role=True, index=i)
            while True:
                for i, c in enumerate(out.outputs):
                    if done[i]:
                        continue
                    finished = out.finished or c.finish_reason is not None
                    text = c.text
                    end = len(text) if finished else max(sent[i], len(text) - holdback)
                    while end > sent[i] and not finished and text[end - 1] == "\ufffd":
                        end -= 1
                    echo_of = out if echo else None
                    echo_now = not echoed[i] and (end > sent[i] or finished)
                    prefix = self._prompt_text(out) if echo_now else ""
                    if end > sent[i] or echo_now:
                        echoed[i] = True
                        lps = self._stream_logprobs(c, chat, lp_sent[i], echo_of)
                        lp_sent[i] = len(c.token_ids) + (len(out.prompt_token_ids) if echo else 0)
                        yield self._chunk(request_id, chat, prefix + text[sent[i]:end],
                                          logprobs=lps, index=i)
                        sent[i] = end
                    if not finished:
                        continue
                    done[i] = True
                    if c.finish_reason == "error":   # kv_load_failure_policy="fail"
                        yield f"data: {json.dumps(error_body('KV load failed', 'InternalServerError', 500))}\n\n"
                    else:
                        yield self._chunk(request_id, chat, None, finish_reason=c.finish_reason,
                                          logprobs=self._stream_logprobs(c, chat, lp_sent[i],
                                                                         echo_of),
                                          index=i)
                if out.finished:
                    break
                out = await gen.__anext__()
            if include_usage:
                usage = {"id": request_id, "object": "chat.completion.chunk" if chat
                         else "text_completion", "created": now(), "model": self.model_name,
                         "choices": [], "usage": usage_body(
                             len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                             out.num_cached_tokens)}
                yield f"data: {json.dumps(usage)}\n\n"
            params = getattr(out, "kv_transfer_params", None)
            if params is not None:
                yield f"data: {json.dumps({'id': request_id, 'kv_transfer_params': params})}\n\n"
        except EngineDeadError as e:
            yield f"data: {json.dumps(error_body(str(e), 'InternalServerError', 500))}\n\n"
        finally:
            await gen.aclose()                  # aborts the request if it is still running
        yield "data: [DONE]\n\n"


def _engine_error(e: Exception) -> Response:
    """What ``AsyncLLM.generate`` raised: overload is a 503; a dead engine loop, or a request the
    engine refused after every check here passed, is a server fault (500) that names itself."""
    if isinstance(e, EngineOverloadedError):
        return error_response(str(e), 503)
    if isinstance(e, DuplicateRequestError):
        return error_response(f"X-Request-Id: {e}", 400, "X-Request-Id")
    if isinstance(e, EngineDeadError):
        return error_response(f"EngineDeadError: {e}", 500)
    return error_response(f"the engine refused a request that passed validation: "
                          f"{type(e).__name__}: {e}", 500)


async def _collect_unless_disconnected(gen: AsyncIterator[RequestOutput],
                                       raw: HTTPRequest) -> Optional[RequestOutput]:
    """The final output, or None when the client disconnected first (the request is aborted:
    cancelling the task closes ``gen``, whose ``finally`` aborts it)."""
    async def drain() -> RequestOutput:
        last = None
        async for out in gen:
            last = out
        return last

    task = asyncio.ensure_future(drain())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            return None
