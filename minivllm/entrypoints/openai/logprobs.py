"""Logprobs in OpenAI's response shapes, mirroring ``_create_completion_logprobs`` and
``_create_chat_logprobs`` in vllm/entrypoints/openai/serving_completion.py / serving_chat.py.

Input: a ``CompletionOutput`` whose ``logprobs`` are vLLM's (per token ``{token_id: Logprob}``).
Logprobs below -9999 (a masked token's ``-inf``) are reported as -9999, as vLLM does: JSON has
no infinity.
"""
from __future__ import annotations

from typing import Any, Optional


def _token_text(lp: Any, token_id: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def completion_logprobs(c: Any, prompt_logprobs: Optional[list] = None,
                        prompt_token_ids: Optional[list[int]] = None,
                        decode: Any = None) -> dict:
    """OpenAI's completion logprobs (vLLM's ``CompletionLogProbs``): per token its text, logprob,
    the alternatives by text, and its offset in the text; with ``echo`` the prompt's tokens first
    (the first prompt token has no logprob: ``null``)."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    positions = list(zip(c.token_ids, c.logprobs))
    if prompt_logprobs is not None:
        positions = list(zip(prompt_token_ids, prompt_logprobs)) + positions
    for tok, pos in positions:
        if pos is None:   # the first prompt token
            text = decode(tok) if decode is not None else f"token_id:{tok}"
            tokens.append(text)
            token_logprobs.append(None)
            top.append(None)
        else:
            text = _token_text(pos[tok], tok)
            tokens.append(text)
            token_logprobs.append(max(pos[tok].logprob, -9999.0))
            top.append({_token_text(lp, t): max(lp.logprob, -9999.0) for t, lp in pos.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def prompt_logprobs_body(prompt_logprobs: list) -> list:
    """vLLM's ``prompt_logprobs`` on a choice: per prompt token ``None`` or
    ``{token_id: {"logprob", "rank", "decoded_token"}}``."""
    return [None if pos is None else {
        str(t): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank,
                 "decoded_token": lp.decoded_token} for t, lp in pos.items()}
        for pos in prompt_logprobs]


def chat_logprobs(c: Any, top_k: int) -> dict:
    """OpenAI's chat logprobs (vLLM's ``ChatCompletionLogProbs``): ``content``, one entry per token
    with ``token``, ``logprob``, ``bytes`` and its ``top_logprobs`` (the k most likely)."""
    def entry(t: int, lp: Any) -> dict:
        text = _token_text(lp, t)
        return {"token": text, "logprob": max(lp.logprob, -9999.0),
                "bytes": list(text.encode("utf-8", errors="replace"))}
    content = []
    for tok, pos in zip(c.token_ids, c.logprobs):
        ranked = sorted(((t, lp) for t, lp in pos.items() if lp.rank <= top_k),
                        key=lambda x: x[1].rank)[:top_k]
        content.append({**entry(tok, pos[tok]), "top_logprobs": [entry(t, lp) for t, lp in ranked]})
    return {"content": content}
