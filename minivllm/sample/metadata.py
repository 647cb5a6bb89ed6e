"""Per-step sampling parameters as tensors, mirroring vllm/v1/sample/metadata.py.

One row per request in the batch (``[batch]``), in the order of the logits rows the sampler gets:
- ``temperature``: ``[batch]`` float32, 0.0 on greedy rows; ``None`` when every row is greedy.
- ``top_p``: ``[batch]`` float32, or ``None`` when no row restricts top-p (all 1.0).
- ``top_k``: ``[batch]`` int64, 0 = off, or ``None`` when no row uses top-k.
- ``generators``: row index -> ``torch.Generator`` for requests with a ``seed``. vLLM's input batch creates
  one generator per request when the request arrives and keeps it, so each step continues the same
  random stream; that is what makes a seeded request reproducible whatever else is in the batch.
- ``min_tokens``: row index -> ``(min_tokens, num_output_tokens, stop_ids)`` for rows whose stop ids
  are still masked (``logits_processor.apply_min_tokens``; vLLM's ``MinTokensLogitsProcessor``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

from minivllm.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    temperature: Optional[torch.Tensor]
    all_greedy: bool
    all_random: bool
    top_p: Optional[torch.Tensor]
    top_k: Optional[torch.Tensor]
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    min_tokens: dict[int, tuple[int, int, list[int]]] = field(default_factory=dict)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: Optional[dict[int, torch.Generator]] = None,
        device: Union[str, torch.device] = "cpu",
        num_output_tokens: Optional[Sequence[int]] = None,
    ) -> "SamplingMetadata":
        """Tensors for one batch, row i from ``params[i]``.

        ``generators`` should be the runner's persistent per-request generators (keyed by row index).
        When ``None``, fresh generators are built from each random row's ``seed``: right for a single
        call (tests, notebooks), wrong across engine steps, where every step would replay the same draws.
        ``num_output_tokens[i]``: request i's output tokens before this step (default 0), for
        ``min_tokens``.
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
        min_tokens = {}
        for i, p in enumerate(params):
            done = num_output_tokens[i] if num_output_tokens is not None else 0
            if done < p.min_tokens and p.all_stop_token_ids:
                min_tokens[i] = (p.min_tokens, done, sorted(p.all_stop_token_ids))
        return cls(temperature=temperature, all_greedy=all_greedy, all_random=all_random,
                   top_p=top_p, top_k=top_k, generators=generators, min_tokens=min_tokens)
