"""Prompts that are not token ids, and prompts the engine refuses: the text path of
``LLMEngine.tokenize_prompt`` (vLLM's ``InputProcessor`` tokenizes a text prompt) and the
messages of ``LLMEngine.validate_prompt``'s errors.

Loaded the first time a prompt is text or is refused; the article's examples give token ids
(``skip_tokenizer_init=True``) that fit, and never read this file.
"""
from __future__ import annotations

from typing import Any, Optional


def tokenize_text_prompt(prompt: Any, tokenizer: Any) -> tuple[Optional[str], list[int]]:
    """A text prompt's (text, token ids); ``ValueError`` for anything that is neither text nor
    ``{'prompt_token_ids': [...]}``, or for text without a tokenizer."""
    if isinstance(prompt, dict):
        raise ValueError("a dict prompt must have the key 'prompt_token_ids'.")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str or {{'prompt_token_ids': [...]}}, got "
                         f"{type(prompt).__name__}.")
    if tokenizer is None:
        raise ValueError("skip_tokenizer_init=True: give prompts as {'prompt_token_ids': [...]}.")
    return prompt, tokenizer.encode(prompt)


def prompt_error(token_ids: list[int], max_model_len: int, vocab_size: int) -> ValueError:
    """Why ``validate_prompt`` refuses these token ids, in the order it checks them."""
    if not token_ids:
        return ValueError("prompt is empty: it must have at least one token.")
    if len(token_ids) >= max_model_len:
        return ValueError(f"prompt has {len(token_ids)} tokens, which leaves no room under "
                          f"max_model_len={max_model_len} (prompt tokens must be < max_model_len).")
    return ValueError(f"prompt_token_ids must be in [0, {vocab_size}) for this model's vocabulary.")
