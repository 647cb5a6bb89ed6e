"""Sampling parameters, mirroring vllm/sampling_params.py.

Defaults are vLLM's: ``temperature=1.0``, ``top_p=1.0``, ``top_k=0`` (off), ``max_tokens=16``, ``n=1``,
no penalties (``presence_penalty = frequency_penalty = 0``, ``repetition_penalty = 1``), ``min_p=0``.
``temperature=0`` means greedy. Every check runs in ``__post_init__`` (vLLM's ``_verify_args``) so a bad
value is a ``ValueError`` naming the field before the engine does any work; the checks that need the
model (token ids inside the vocabulary, ``bad_words`` tokenised) run in ``verify_for_model`` when the
engine takes the request (vLLM's ``InputProcessor`` calls ``update_from_tokenizer`` and the
``_validate_*`` methods there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional, Union

_SAMPLING_EPS = 1e-5
MAX_N_SEQUENCES = 16384       # vLLM's VLLM_MAX_N_SEQUENCES
MAX_NUM_BAD_WORDS = 128       # vLLM's VLLM_MAX_NUM_BAD_WORDS
# vLLM's LogprobsMode (the engine's logprobs_mode): what logprobs hold (sample/ops/logprobs.py).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


# The fields beyond the article's (temperature, top_p, top_k, max_tokens, n, seed, ignore_eos): the
# logits processors, stop conditions and logprobs. Their checks run on every construction
# (``_verify_args``), whatever the other fields are.
OPTIONS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "stop",
           "stop_token_ids", "bad_words", "min_tokens", "logprobs", "prompt_logprobs", "logit_bias",
           "allowed_token_ids")


def check_logprobs_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}.")
    return mode


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    # Top-k logprobs per output token (-1: the whole vocabulary), and per prompt token.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    extra_args: Optional[dict] = None
    # Filled in by the engine from the tokenizer / model config; not user-facing.
    _all_stop_token_ids: set = field(default_factory=set, repr=False)
    # The model's EOS id (set by Request); min_tokens masks it too, as vLLM does.
    _eos_token_id: Optional[int] = field(default=None, repr=False)
    # bad_words as token id sequences (update_from_tokenizer).
    _bad_words_token_ids: Optional[list[list[int]]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: top-p / top-k / min-p are irrelevant; normalise them like vLLM does.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify_args(self) -> None:
        """vLLM 0.32's ``SamplingParams._verify_args`` for the article's fields (the others:
        the options below them): the same ranges, each message naming the field."""
        if not isinstance(self.n, int) or isinstance(self.n, bool):
            raise ValueError(f"n must be an int, but is of type {type(self.n)}")
        if not 1 <= self.n <= MAX_N_SEQUENCES:
            raise ValueError(f"n must be at least 1 and at most {MAX_N_SEQUENCES}, got {self.n}.")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables top-k), got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.n > 1 and self.temperature < _SAMPLING_EPS:
            # vLLM's _verify_greedy_sampling: n greedy copies would all be the same.
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")
        # The options beyond the article's; ``logit_bias`` keys become ints (JSON keys are
        # strings; vLLM converts them in ``SamplingParams.from_optional``).
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}.") from None
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise ValueError("repetition_penalty must be a finite number greater than zero, got "
                             f"{self.repetition_penalty}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}).")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < -1):
                raise ValueError(f"{name} must be non-negative or -1, got {value}.")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty.")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            raise ValueError("allowed_token_ids is not None and empty!")

    def verify_for_model(self, vocab_size: int, tokenizer: Any = None,
                         max_logprobs: Optional[int] = None) -> None:
        """The checks that need the model, when the engine takes the request (vLLM's
        ``_validate_logit_bias``, ``_validate_allowed_token_ids``, ``update_from_tokenizer``, and
        ``logprobs`` / ``prompt_logprobs`` at most the engine's ``max_logprobs``)."""
        bad = [t for t in (self.logit_bias or {}) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                             f"Vocabulary size: {vocab_size}")
        if self.allowed_token_ids is not None and not all(0 <= t < vocab_size for t in self.allowed_token_ids):
            raise ValueError("allowed_token_ids contains out-of-vocab token id!")
        if self.bad_words:
            if tokenizer is None:
                raise ValueError("bad_words needs a tokenizer (skip_tokenizer_init=True has none).")
            self.update_from_tokenizer(tokenizer)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if max_logprobs is not None and value is not None and value > max_logprobs:
                raise ValueError(f"{name}: requested {value}, which is greater than max allowed: "
                                 f"{max_logprobs}.")

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """``bad_words`` -> ``_bad_words_token_ids``, as vLLM (``bad_words_token_ids``)."""
        self._bad_words_token_ids = bad_words_token_ids(self.bad_words, tokenizer)

    @property
    def bad_words_token_ids(self) -> Optional[list[list[int]]]:
        return self._bad_words_token_ids

    # The three below are read at every step the request runs (SamplingMetadata.from_params);
    # cached on first read, as vLLM caches ``sampling_type``: the fields they read are fixed once
    # the engine has the request (bad words tokenised in ``verify_for_model``).
    @cached_property
    def no_penalties(self) -> bool:
        return (abs(self.presence_penalty) < _SAMPLING_EPS
                and abs(self.frequency_penalty) < _SAMPLING_EPS
                and abs(self.repetition_penalty - 1.0) < _SAMPLING_EPS)

    @cached_property
    def needs_processor_fields(self) -> bool:
        """Whether ``SamplingMetadata`` needs this request's penalties, ``min_p``, logit bias,
        allowed ids, bad words, ``min_tokens`` or logprobs
        (``SamplingMetadata._fill_logits_processor_fields``)."""
        return not (self.no_penalties and self.min_p <= _SAMPLING_EPS and not self.logit_bias
                    and self.allowed_token_ids is None and not self._bad_words_token_ids
                    and self.logprobs is None and self.min_tokens == 0)

    @property
    def all_stop_token_ids(self) -> set[int]:
        """What ``min_tokens`` masks (vLLM's ``SamplingParams.all_stop_token_ids``): the stop token
        ids, the extra EOS ids and the EOS id (masked even with ``ignore_eos``, as in vLLM)."""
        eos = set() if self._eos_token_id is None else {self._eos_token_id}
        return self._all_stop_token_ids | eos

    @cached_property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS


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
