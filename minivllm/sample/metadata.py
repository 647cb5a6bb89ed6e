"""Per-step sampling parameters as tensors, mirroring vllm/v1/sample/metadata.py.

One row per request in the batch (``[batch]``), in the order of the logits rows the sampler gets:
- ``temperature``: ``[batch]`` float32, 0.0 on greedy rows; ``None`` when every row is greedy.
- ``top_p``: ``[batch]`` float32, or ``None`` when no row restricts top-p (all 1.0).
- ``top_k``: ``[batch]`` int64, 0 = off, or ``None`` when no row uses top-k.
- ``generators``: row index -> ``torch.Generator`` for requests with a ``seed``. vLLM's input batch creates
  one generator per request when the request arrives and keeps it, so each step continues the same
  random stream; that is what makes a seeded request reproducible whatever else is in the batch.

The fields of vLLM 0.32's metadata for the logits processors (``sample/ops/``), filled by
``_fill_logits_processor_fields`` only when a row's ``SamplingParams`` asks for one
(``needs_processor_fields``); each is empty or ``None`` when no row uses it, so a plain batch pays
nothing:
- ``min_tokens``: row index -> ``(min_tokens, num_output_tokens, stop_ids)`` for rows whose stop ids
  are still masked (``logits_processor.apply_min_tokens``; vLLM's ``MinTokensLogitsProcessor``).
- ``presence_penalties``, ``frequency_penalties``, ``repetition_penalties``: ``[batch]`` float32, or
  all ``None`` (vLLM's ``no_penalties``); ``prompt_token_ids`` and ``output_token_ids`` (lists per
  row) are then filled: the penalties read them.
- ``min_p``: ``[batch]`` float32 or ``None``; ``logit_bias``: row -> {token_id: bias};
  ``allowed_token_ids``: row -> the allowed ids; ``bad_words_token_ids``: row -> token id sequences.
- ``spec_token_ids``: per row the drafts being verified this step (the rejection sampler counts
  them as outputs at the later draft positions).
- ``max_num_logprobs``: the largest ``logprobs`` of the batch (-1: whole vocabulary), or ``None``.

Article step: the sampling that ends every step, and spec step 7 (rejection sampling).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from minivllm.sampling_params import _SAMPLING_EPS, SamplingParams


@dataclass
class SamplingMetadata:
    temperature: Optional[torch.Tensor]
    all_greedy: bool
    all_random: bool
    top_p: Optional[torch.Tensor]
    top_k: Optional[torch.Tensor]
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    min_tokens: dict[int, tuple[int, int, list[int]]] = field(default_factory=dict)
    presence_penalties: Optional[torch.Tensor] = None
    frequency_penalties: Optional[torch.Tensor] = None
    repetition_penalties: Optional[torch.Tensor] = None
    prompt_token_ids: Optional[list[list[int]]] = None
    output_token_ids: list[list[int]] = field(default_factory=list)
    spec_token_ids: Optional[list[list[int]]] = None
    min_p: Optional[torch.Tensor] = None
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    max_num_logprobs: Optional[int] = None

    @property
    def no_penalties(self) -> bool:
        return self.presence_penalties is None

    @property
    def needs_logits_processors(self) -> bool:
        """Whether a row asked for one of vLLM 0.32's logits processors (``ops/processors.py``)."""
        return bool(self.allowed_token_ids or self.bad_words_token_ids or self.min_tokens
                    or self.logit_bias) or not self.no_penalties

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Optional[dict[int, torch.Generator]] = None,
        device: Union[str, torch.device] = "cpu",
        num_output_tokens: Optional[Sequence[int]] = None,
        prompt_token_ids: Optional[Sequence[list[int]]] = None,
        output_token_ids: Optional[Sequence[list[int]]] = None,
        spec_token_ids: Optional[Sequence[list[int]]] = None,
    ) -> "SamplingMetadata":
        """Tensors for one batch, row i from ``params[i]``.

        ``generators`` should be the runner's persistent per-request generators (keyed by row index).
        When ``None``, fresh generators are built from each random row's ``seed``: right for a single
        call (tests, notebooks), wrong across engine steps, where every step would replay the same draws.
        ``num_output_tokens[i]``: request i's output tokens before this step (default 0), for
        ``min_tokens``. ``prompt_token_ids`` / ``output_token_ids`` / ``spec_token_ids`` (lists per
        row; default empty) are what penalties and bad words count.
        """
        greedy = [p.sampling_type_greedy for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        if generators is None:
            generators = {}
            for i, p in enumerate(params):
                if not greedy[i] and p.seed is not None:
                    generators[i] = torch.Generator(device=device).manual_seed(p.seed)

        temperature = None
        if not all_greedy:
            # Greedy rows carry 0.0 (vLLM's GREEDY_TEMPERATURE); samplers swap it for 1.0 before dividing.
            temperature = torch.tensor(
                [0.0 if g else p.temperature for g, p in zip(greedy, params)],
                dtype=torch.float32, device=device)
        top_p = None
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        top_k = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
        if output_token_ids is None:
            output_token_ids = [[] for _ in params]
        md = cls(temperature=temperature, all_greedy=all_greedy, all_random=all_random,
                 top_p=top_p, top_k=top_k, generators=generators,
                 # References, not copies: the ops only read them (vLLM's metadata does the same).
                 output_token_ids=list(output_token_ids),
                 spec_token_ids=None if spec_token_ids is None else list(spec_token_ids))
        if any(p.needs_processor_fields for p in params):   # vLLM 0.32's options (sample/ops/)
            md._fill_logits_processor_fields(params, prompt_token_ids, num_output_tokens, device)
        return md

    def _fill_logits_processor_fields(self, params: Sequence[SamplingParams],
                                      prompt_token_ids: Optional[Sequence[list[int]]],
                                      num_output_tokens: Optional[Sequence[int]],
                                      device: Union[str, torch.device]) -> None:
        """The penalties, min_p, logit bias, allowed ids, bad words, min_tokens and logprobs
        fields, after ``output_token_ids`` is filled; the arguments as in ``from_params``."""
        if not all(p.no_penalties for p in params):
            t = lambda name: torch.tensor([getattr(p, name) for p in params],  # noqa: E731
                                          dtype=torch.float32, device=device)
            self.presence_penalties = t("presence_penalty")
            self.frequency_penalties = t("frequency_penalty")
            self.repetition_penalties = t("repetition_penalty")
            self.prompt_token_ids = (list(prompt_token_ids) if prompt_token_ids is not None
                                     else [[] for _ in params])
        if any(p.min_p > _SAMPLING_EPS for p in params):
            self.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        self.logit_bias = {i: p.logit_bias for i, p in enumerate(params) if p.logit_bias}
        self.allowed_token_ids = {i: list(p.allowed_token_ids) for i, p in enumerate(params)
                                  if p.allowed_token_ids is not None}
        self.bad_words_token_ids = {i: p.bad_words_token_ids for i, p in enumerate(params)
                                    if p.bad_words_token_ids}
        for i, p in enumerate(params):   # the rows whose stop ids are still masked
            done = (num_output_tokens[i] if num_output_tokens is not None
                    else len(self.output_token_ids[i]))
            if done < p.min_tokens and p.all_stop_token_ids:
                self.min_tokens[i] = (p.min_tokens, done, sorted(p.all_stop_token_ids))
        asked = [p.logprobs for p in params if p.logprobs is not None]
        if asked:
            self.max_num_logprobs = -1 if -1 in asked else max(asked)
