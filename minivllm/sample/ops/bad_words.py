"""Bad words, mirroring vllm/v1/sample/ops/bad_words.py.

A bad word is a token id sequence (``SamplingParams.update_from_tokenizer``). Its last token is
masked (logit ``-inf``) at a position when the tokens just before it equal the rest of the word:
a one-token word is always masked; a longer one only once its prefix has been output.
"""
from __future__ import annotations

import torch

_SMALLEST_LOGIT = float("-inf")


def _apply_bad_words_single_batch(logits: torch.Tensor, bad_words_token_ids: list[list[int]],
                                  past_tokens_ids: list[int]) -> None:
    for bad_word_ids in bad_words_token_ids:
        if len(bad_word_ids) > len(past_tokens_ids) + 1:
            continue
        prefix_length = len(bad_word_ids) - 1
        actual_prefix = past_tokens_ids[-prefix_length:] if prefix_length > 0 else []
        if actual_prefix == bad_word_ids[:prefix_length]:
            logits[bad_word_ids[-1]] = _SMALLEST_LOGIT


def apply_bad_words(logits: torch.Tensor, bad_words_token_ids: dict[int, list[list[int]]],
                    past_tokens_ids: list[list[int]]) -> None:
    """``logits`` ``[rows, vocab]`` masked in place; ``bad_words_token_ids``: row -> words;
    ``past_tokens_ids[row]``: the output tokens before that row's position."""
    for i, bad_words_ids in bad_words_token_ids.items():
        _apply_bad_words_single_batch(logits[i], bad_words_ids, past_tokens_ids[i])
