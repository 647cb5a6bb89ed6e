"""The checks of the sampling options beyond the article's examples, beside ``SamplingParams``
(sampling_params.py): penalties, ``min_p``, stop conditions, ``min_tokens``, logprobs, logit bias,
allowed token ids and bad words (vLLM 0.32's ``SamplingParams._verify_args``, ``_validate_*`` and
``update_from_tokenizer``, vllm/sampling_params.py). Loaded only when a request sets one of them
(``SamplingParams.OPTIONS``), so the article's examples never read it.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from minivllm.sampling_params import SamplingParams

MAX_NUM_BAD_WORDS = 128       # vLLM's VLLM_MAX_NUM_BAD_WORDS


def verify_options(p: SamplingParams) -> None:
    """vLLM's ranges for the options, each message naming the field; ``logit_bias`` keys become
    ints (JSON keys are strings; vLLM converts them in ``SamplingParams.from_optional``)."""
    if p.logit_bias is not None:
        try:
            p.logit_bias = {int(t): float(b) for t, b in p.logit_bias.items()}
        except (TypeError, ValueError, AttributeError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {p.logit_bias!r}.") from None
    if not -2.0 <= p.presence_penalty <= 2.0:
        raise ValueError(f"presence_penalty must be in [-2, 2], got {p.presence_penalty}.")
    if not -2.0 <= p.frequency_penalty <= 2.0:
        raise ValueError(f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}.")
    if not math.isfinite(p.repetition_penalty) or p.repetition_penalty <= 0.0:
        raise ValueError("repetition_penalty must be a finite number greater than zero, got "
                         f"{p.repetition_penalty}.")
    if not 0.0 <= p.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p}.")
    if p.min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {p.min_tokens}.")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(f"min_tokens ({p.min_tokens}) must be <= max_tokens ({p.max_tokens}).")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None and (not isinstance(value, int) or value < -1):
            raise ValueError(f"{name} must be non-negative or -1, got {value}.")
    if not all(isinstance(t, int) for t in p.stop_token_ids):
        raise ValueError(f"stop_token_ids must contain only integers, got {p.stop_token_ids}.")
    if any(not s for s in p.stop):
        raise ValueError("stop strings must be non-empty.")
    if any(not isinstance(w, str) or not w for w in p.bad_words):
        raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={p.bad_words}")
    if p.allowed_token_ids is not None and len(p.allowed_token_ids) == 0:
        raise ValueError("allowed_token_ids is not None and empty!")


def verify_for_model(p: SamplingParams, vocab_size: int, tokenizer: Any,
                     max_logprobs: Optional[int]) -> None:
    """vLLM's ``_validate_logit_bias`` and ``_validate_allowed_token_ids``; ``bad_words``
    tokenised (``update_from_tokenizer``); ``logprobs`` within the engine's ``max_logprobs``
    (checked where vLLM's input processor checks it)."""
    bad = [t for t in (p.logit_bias or {}) if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                         f"Vocabulary size: {vocab_size}")
    if p.allowed_token_ids is not None and not all(0 <= t < vocab_size for t in p.allowed_token_ids):
        raise ValueError("allowed_token_ids contains out-of-vocab token id!")
    if p.bad_words:
        if tokenizer is None:
            raise ValueError("bad_words needs a tokenizer (skip_tokenizer_init=True has none).")
        p.update_from_tokenizer(tokenizer)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if max_logprobs is not None and value is not None and value > max_logprobs:
            raise ValueError(f"{name}: requested {value}, which is greater than max allowed: "
                             f"{max_logprobs}.")


def bad_words_token_ids(bad_words: list[str], tokenizer: Any) -> list[list[int]]:
    """vLLM's ``update_from_tokenizer``: each word without and with a leading space (a word at the
    start of the text and in the middle tokenise differently); the spaced form is kept only when it
    is a different token sequence of the same length."""
    token_id_lists: list[list[int]] = []
    for bad_word in bad_words:
        for add_prefix_space in (False, True):
            prompt = (" " if add_prefix_space else "") + bad_word.lstrip()
            token_ids = tokenizer.encode(prompt, add_special_tokens=False)
            if not token_ids:
                if not add_prefix_space:
                    raise ValueError("bad_words entries must tokenize to at least one token.")
                continue
            last = token_id_lists[-1] if token_id_lists else None
            if not add_prefix_space or (token_ids[0] != last[0] and len(token_ids) == len(last)):
                token_id_lists.append(token_ids)
                if len(token_id_lists) > MAX_NUM_BAD_WORDS:
                    raise ValueError(f"bad_words: too many bad words after tokenization: "
                                     f"{len(token_id_lists)}. The max number is {MAX_NUM_BAD_WORDS}.")
    return token_id_lists
