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

The backends (``_kernels``): "reference" says the article's rule as it reads, one request at a
time (``rejection_reference.py``; the tour's ``--plain``); "torch" and "triton" (the kernels in
``rejection_kernels.py``) sample the residual by vLLM's exponential race (``race_random_sample``),
so that their ids equal vLLM 0.32's from the same draws. The uniform draws are made here in torch,
once, for every backend. The torch loop writes its output as the article does
(``accept_left_to_right``: per request, left to right, stop at the first rejection), the loop each
program of the Triton kernels runs. On a CPU it is also the fast path: at batch 1-32 and k 1-5 the
plain loop over Python lists takes 8-37 us, a cumprod/scatter vectorisation 110-150 us.
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
                                    apply_sampling_constraints, expand_batch_to_tokens_torch,
                                    random_accept_mask)
from minivllm.sample.metadata import SamplingMetadata

if TYPE_CHECKING:   # annotations only: the drafts' metadata loads with speculative decoding
    from minivllm.sample.spec_decode_metadata import SpecDecodeMetadata
from minivllm.sample.sampler import exponential_noise

PLACEHOLDER_TOKEN_ID = -1


# ---------------------------------------------------------------------------------------------------
# The torch loop (same signatures as the ``*_triton`` launchers in rejection_kernels.py).

def accept_left_to_right(output_token_ids, rows, cu_num_draft_tokens, draft_token_ids, accepted,
                         recovered_token_ids, bonus_token_ids) -> None:
    """Article step "accept/reject left to right", one request at a time (what one program of
    ``rejection_*_sample_kernel`` does).

    For each request in ``rows`` ([batch] bool), go over its drafts left to right: while
    ``accepted[token]`` holds, the draft is output; at the first rejection the recovered token is
    output there and the request stops; when nothing was rejected, the bonus token follows the last
    draft. Every other slot keeps ``PLACEHOLDER_TOKEN_ID``.

    ``accepted``, ``draft_token_ids``, ``recovered_token_ids``: ``[num_tokens]``;
    ``output_token_ids`` ``[batch, max_spec_len + 1]`` int32, written in place.
    """
    # Plain Python lists: reading a tensor element by element costs microseconds each.
    out = output_token_ids.tolist()
    rows, cu, drafts, accepted, recovered, bonus = (t.tolist() for t in (
        rows, cu_num_draft_tokens, draft_token_ids, accepted, recovered_token_ids,
        bonus_token_ids.view(-1)))
    start_idx = 0
    for req_idx, end_idx in enumerate(cu):
        if rows[req_idx]:
            row = out[req_idx]
            for pos, token_idx in enumerate(range(start_idx, end_idx)):
                if not accepted[token_idx]:
                    row[pos] = recovered[token_idx]
                    break
                row[pos] = drafts[token_idx]
            else:
                row[end_idx - start_idx] = bonus[req_idx]
        start_idx = end_idx
    output_token_ids.copy_(torch.tensor(out, dtype=torch.int32, device=output_token_ids.device)
                           .view(output_token_ids.shape))


def rejection_greedy_sample_torch(output_token_ids, cu_num_draft_tokens, draft_token_ids,
                                  target_argmax, bonus_token_ids, is_greedy, max_spec_len) -> None:
    """Greedy rows: a draft is accepted iff it is the target's argmax; at the first mismatch the
    argmax is output instead (it counts as the recovered token)."""
    accepted = draft_token_ids.long() == target_argmax.long()
    accept_left_to_right(output_token_ids, is_greedy, cu_num_draft_tokens, draft_token_ids,
                         accepted, target_argmax, bonus_token_ids)


def rejection_random_sample_torch(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                  target_probs, bonus_token_ids, recovered_token_ids, uniform_probs,
                                  is_greedy, max_spec_len) -> None:
    """Random rows: a draft is accepted iff ``u <= p_target / p_draft`` (``random_accept_mask``,
    evaluated for every draft at once: one draft's test does not depend on the others)."""
    accepted = random_accept_mask(draft_token_ids, draft_probs, target_probs, uniform_probs)
    accept_left_to_right(output_token_ids, ~is_greedy, cu_num_draft_tokens, draft_token_ids,
                         accepted, recovered_token_ids, bonus_token_ids)


def sample_recovered_tokens_torch(cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, q,
                                  max_spec_len) -> torch.Tensor:
    real = (draft_token_ids >= 0).unsqueeze(-1)
    idx = draft_token_ids.long().clamp(min=0).unsqueeze(-1)
    if draft_probs is None:
        prob = target_probs.scatter(-1, idx, 0.0)
    else:
        prob = (target_probs - draft_probs).clamp_min(0.0)
    # A placeholder drafted nothing: its recovered token is drawn from p_target itself.
    prob = torch.where(real, prob, target_probs)
    counts = torch.diff(cu_num_draft_tokens.long(), prepend=cu_num_draft_tokens.new_zeros(1).long())
    q_per_token = q.repeat_interleave(counts, dim=0, output_size=draft_token_ids.numel())
    return (prob / q_per_token).argmax(dim=-1).to(draft_token_ids.dtype)


def race_random_sample(recover, random_sample, output_token_ids, num_draft_tokens,
                       cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                       bonus_token_ids, uniform_probs, is_greedy, generators) -> None:
    """Random rows as vLLM 0.32 samples them, so that the ids equal vLLM's from the same draws
    (conformance case d): every draft's recovered token is drawn up front by an exponential race,
    ``argmax(residual / q)`` with ``q ~ Exp(1)`` per request, which picks token ``t`` with
    probability ``residual(t) / sum(residual)``: the same distribution as the article's draw from
    ``normalize(max(p_target - p_draft, 0))`` (rejection_reference.py), without normalising."""
    max_spec_len = output_token_ids.shape[1] - 1
    q = generate_recovery_noise(len(num_draft_tokens), target_probs.shape[-1], num_draft_tokens,
                                generators, target_probs.device)
    recovered = recover(cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, q,
                        max_spec_len)
    random_sample(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                  bonus_token_ids, recovered, uniform_probs, is_greedy, max_spec_len)


def _kernels(backend: str) -> tuple:
    """(greedy sample, random sample) of ``backend``. "reference" is the article's rule as it reads
    (rejection_reference.py); "torch" and "triton" are vLLM's race. The Triton kernels are imported
    only when asked for: a CPU run with the torch loop never loads Triton."""
    if backend == "reference":
        from minivllm.sample.rejection_reference import rejection_random_sample_reference
        return rejection_greedy_sample_torch, rejection_random_sample_reference
    if backend == "torch":
        return rejection_greedy_sample_torch, functools.partial(
            race_random_sample, sample_recovered_tokens_torch, rejection_random_sample_torch)
    from minivllm.sample import rejection_kernels as K
    return K.rejection_greedy_sample_triton, functools.partial(
        race_random_sample, K.sample_recovered_tokens_triton, K.rejection_random_sample_triton)


# ---------------------------------------------------------------------------------------------------
# The random draws (torch only, shared by every backend).

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


def generate_recovery_noise(batch_size: int, vocab_size: int, num_draft_tokens: list[int],
                            generators: dict[int, torch.Generator], device) -> torch.Tensor:
    """``q`` ``[batch, vocab]`` float32 Exp(1): one row per request, shared by all its positions."""
    used = {i: g for i, g in generators.items() if num_draft_tokens[i] > 0}
    return exponential_noise((batch_size, vocab_size), used, device)


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
    rejection_reference.py), or "auto": ``$MINIVLLM_REJECTION_SAMPLER`` when set (the tour's
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
        if backend not in ("torch", "triton", "reference"):
            raise ValueError(f"backend must be 'auto', 'torch', 'triton' or 'reference' (also for "
                             f"MINIVLLM_REJECTION_SAMPLER), got {backend!r}.")
        self.backend = backend
        self.record = False
        self.last_record: Optional[list[list[dict]]] = None
        # The logits each draft was tested against ([num_draft_tokens, vocab], after the logits
        # processors and the sampling constraints), for the logprobs of the accepted tokens.
        self.last_target_logits: Optional[torch.Tensor] = None

    def forward(self, metadata: SpecDecodeMetadata, draft_probs: Optional[torch.Tensor],
                target_logits: torch.Tensor, bonus_token_ids: torch.Tensor,
                sampling_metadata: SamplingMetadata) -> torch.Tensor:
        _check_inputs(metadata, draft_probs, target_logits, bonus_token_ids, sampling_metadata)
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


def _check_inputs(metadata, draft_probs, target_logits, bonus_token_ids, sampling_metadata) -> None:
    num_tokens, batch = metadata.draft_token_ids.numel(), len(metadata.num_draft_tokens)
    if target_logits.dim() != 2 or target_logits.shape[0] != num_tokens:
        raise ValueError(f"target_logits must be [num_draft_tokens={num_tokens}, vocab], "
                         f"got {tuple(target_logits.shape)}.")
    if draft_probs is not None and draft_probs.shape != target_logits.shape:
        raise ValueError(f"draft_probs must match target_logits {tuple(target_logits.shape)}, "
                         f"got {tuple(draft_probs.shape)}.")
    if bonus_token_ids.numel() != batch:
        raise ValueError(f"bonus_token_ids must be [batch={batch}, 1], got {tuple(bonus_token_ids.shape)}.")
    temperature = sampling_metadata.temperature
    if not sampling_metadata.all_greedy and (temperature is None or temperature.numel() != batch):
        raise ValueError(f"sampling_metadata.temperature must be [batch={batch}] unless all greedy.")
