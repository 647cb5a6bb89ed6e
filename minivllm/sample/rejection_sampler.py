"""Verify drafts against the target model, mirroring vllm/v1/sample/rejection_sampler.py.

Article step "accept/reject left to right". ``RejectionSampler(backend)(metadata, draft_probs,
target_logits, bonus_token_ids, sampling_metadata)`` returns int32 ``[batch, max_spec_len + 1]``:
per request its accepted drafts, then one more token (the *recovered* token at the first rejection,
or the *bonus* token when every draft passed), then ``PLACEHOLDER_TOKEN_ID`` (-1).

- ``metadata``: ``SpecDecodeMetadata`` (drafts flattened, ``num_tokens`` of them).
- ``draft_probs``: ``[num_tokens, vocab]`` float32, or ``None`` for one-hot drafts (n-gram, Medusa,
  and EAGLE / the draft model with ``draft_sample_method="greedy"``, the default; "probabilistic"
  hands the drafter's real distributions, as vLLM 0.32 can).
- ``target_logits``: ``[num_tokens, vocab]``, row j = the target's logits at draft j's position.
- ``bonus_token_ids``: ``[batch, 1]``, sampled elsewhere from the logits after the last draft.

Random rows accept draft x iff ``p_draft(x) > 0`` and ``p_target(x) / p_draft(x) >= u``, ``u ~ U[0, 1)``;
on rejection the recovered token is drawn from ``normalize(max(p_target - p_draft, 0))``. Each output
position is then distributed exactly as the target (Leviathan et al. 2023). A draft id of -1
(``PLACEHOLDER_TOKEN_ID``: an async-scheduling placeholder with no real draft behind it, vLLM 0.32's
rejection_sampler.py ``draft_token_id < 0``) is always rejected, on greedy and random rows and in
every backend, and its recovered token comes from ``p_target`` alone; no kernel reads a
probability at index -1.

The backends (``_kernels``), each in a file of its own, imported when it first runs: "reference"
says the article's rule as it reads, one request at a time (``rejection_reference.py``; the tour's
``--plain``); "torch" (the torch loop, ``rejection_torch.py``) and "triton" (the kernels in
``rejection_kernels.py``) sample the residual by vLLM's exponential race (``race_random_sample``),
so that their ids equal vLLM 0.32's from the same draws. The uniform draws are made here in torch,
once, for every backend. The torch loop writes its output as the article does
(``accept_left_to_right``: per request, left to right, stop at the first rejection), the loop each
program of the Triton kernels runs, and on a CPU it is the fast path.
"""
from __future__ import annotations

import functools
import itertools
import os
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from minivllm import trace
from minivllm.sample.accept import (_is_greedy, apply_draft_logits_processors,
                                    apply_sampling_constraints)
from minivllm.sample.metadata import SamplingMetadata

if TYPE_CHECKING:   # annotations only: the drafts' metadata loads with speculative decoding
    from minivllm.sample.spec_decode_metadata import SpecDecodeMetadata

PLACEHOLDER_TOKEN_ID = -1


def _kernels(backend: str) -> tuple:
    """(greedy sample, random sample) of ``backend``. "reference" is the article's rule as it reads
    (rejection_reference.py); "torch" and "triton" are vLLM's race (rejection_torch.py). Each
    backend is imported only when it first runs: a run without drafts loads none, and a CPU run with
    the torch loop never loads Triton."""
    from minivllm.sample import rejection_torch as T
    if backend == "reference":
        from minivllm.sample.rejection_reference import rejection_random_sample_reference
        return T.rejection_greedy_sample_torch, rejection_random_sample_reference
    if backend == "block":   # rejection_sample_method="block": block verification (rejection_block.py)
        from minivllm.sample.rejection_block import block_random_sample
        return T.rejection_greedy_sample_torch, block_random_sample
    if backend == "torch":
        return T.rejection_greedy_sample_torch, functools.partial(
            T.race_random_sample, T.sample_recovered_tokens_torch, T.rejection_random_sample_torch)
    from minivllm.sample import rejection_kernels as K
    return K.rejection_greedy_sample_triton, functools.partial(
        T.race_random_sample, K.sample_recovered_tokens_triton, K.rejection_random_sample_triton)


# ---------------------------------------------------------------------------------------------------
# The uniform draws (torch only, shared by every backend; the race's noise is rejection_torch.py's).

def generate_uniform_probs(num_tokens: int, num_draft_tokens: list[int],
                           generators: dict[int, torch.Generator], device) -> torch.Tensor:
    """``[num_tokens]`` float64 U[0, 1); seeded requests with drafts redraw their slice themselves."""
    uniform_probs = torch.rand(num_tokens, dtype=torch.float64, device=device)
    if generators:
        starts = [0, *itertools.accumulate(num_draft_tokens)]
        for i, generator in generators.items():
            if num_draft_tokens[i] > 0:
                uniform_probs[starts[i]:starts[i + 1]].uniform_(generator=generator)
    return uniform_probs


# ---------------------------------------------------------------------------------------------------

def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                     target_probs, target_argmax, bonus_token_ids, sampling_metadata,
                     backend: str = "torch") -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Output ``[batch, max_spec_len + 1]`` int32 and the uniform draws (``None`` if all greedy)."""
    greedy_sample, random_sample = _kernels(backend)
    batch_size, device = len(num_draft_tokens), target_probs.device
    output = torch.full((batch_size, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
                        device=device)
    is_greedy = _is_greedy(sampling_metadata, batch_size, device)
    if not sampling_metadata.all_random:
        greedy_sample(output, cu_num_draft_tokens, draft_token_ids, target_argmax, bonus_token_ids,
                      is_greedy, max_spec_len)
        if sampling_metadata.all_greedy:
            return output, None
    generators = sampling_metadata.generators
    uniform_probs = generate_uniform_probs(draft_token_ids.numel(), num_draft_tokens, generators, device)
    random_sample(output, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                  target_probs, bonus_token_ids, uniform_probs, is_greedy, generators)
    return output, uniform_probs


class RejectionSampler(nn.Module):
    """``backend``: "torch", "triton", "reference" (the article's rule as it reads:
    rejection_reference.py), "block" (block verification, ``rejection_sample_method="block"``:
    rejection_block.py), or "auto": ``$MINIVLLM_REJECTION_SAMPLER`` when set (the tour's
    ``--plain`` sets "reference"), else Triton on CUDA and the torch loop otherwise.

    With ``record = True`` (or inside a recording trace step) each call leaves ``last_record``: per request, per
    position up to and including the emitted token, a dict with draft_token_id (None for a bonus),
    p_target, p_draft (1.0 for one-hot drafts; None for a bonus), uniform (None on greedy rows and for
    a bonus), accepted (False for a bonus: no draft was tested), kind ("accepted" | "recovered" |
    "bonus"; a greedy mismatch emits the target argmax, which counts as recovered) and
    output_token_id, all read from the tensors the kernels used.
    """

    def __init__(self, backend: str = "auto") -> None:
        super().__init__()
        if backend == "auto":
            backend = os.environ.get("MINIVLLM_REJECTION_SAMPLER") or (
                "triton" if torch.cuda.is_available() else "torch")
        if backend not in ("torch", "triton", "reference", "block"):
            raise ValueError(f"backend must be 'auto', 'torch', 'triton', 'reference' or 'block' "
                             f"(also for MINIVLLM_REJECTION_SAMPLER), got {backend!r}.")
        self.backend = backend
        self.record = False
        self.last_record: Optional[list[list[dict]]] = None
        # The logits each draft was tested against ([num_draft_tokens, vocab], after the logits
        # processors and the sampling constraints), for the logprobs of the accepted tokens.
        self.last_target_logits: Optional[torch.Tensor] = None

    def forward(self, metadata: SpecDecodeMetadata, draft_probs: Optional[torch.Tensor],
                target_logits: torch.Tensor, bonus_token_ids: torch.Tensor,
                sampling_metadata: SamplingMetadata) -> torch.Tensor:
        metadata.check_verify_inputs(draft_probs, target_logits, bonus_token_ids,
                                     sampling_metadata)
        if draft_probs is not None:
            draft_probs = draft_probs.float()
        # Penalties, bias, masks and min_tokens on each draft's own output position, the earlier
        # drafts counted as outputs: a draft is tested against what plain sampling would see there.
        logits = apply_draft_logits_processors(target_logits.float(), sampling_metadata, metadata)
        logits = apply_sampling_constraints(logits, metadata, sampling_metadata, self.backend)
        self.last_target_logits = logits
        target_probs = logits.softmax(dim=-1, dtype=torch.float32)
        # vLLM 0.32 takes the argmax of the logits too (rejection_sampler.py, target_logits.argmax),
        # the same token the Sampler picks; the probs' argmax could differ where softmax rounds.
        target_argmax = logits.argmax(dim=-1)
        output, uniform_probs = rejection_sample(
            metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
            metadata.cu_num_draft_tokens, draft_probs, target_probs, target_argmax, bonus_token_ids,
            sampling_metadata, self.backend)
        if self.record or trace.is_recording():
            # The model runner turns these into "spec_verify" trace events keyed by request id.
            from minivllm.sample.verify_record import build_record
            self.last_record = build_record(metadata, sampling_metadata, target_logits, draft_probs,
                                            target_probs, target_argmax, uniform_probs, output)
        return output


    @staticmethod
    def parse_output(output_token_ids: torch.Tensor, vocab_size: int,
                     discard_req_indices=()) -> list[list[int]]:
        """Each row's valid ids: not the placeholder, inside the vocabulary; discarded rows empty."""
        rows = output_token_ids.tolist()
        discard = set(discard_req_indices)
        return [[] if i in discard else [t for t in row if 0 <= t < vocab_size]
                for i, row in enumerate(rows)]
