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

The backends, each in a file of its own, chosen in ``rejection_sample`` by an ``if`` on the
configured name: "reference" says the article's rule as it reads, one request at a time
(``rejection_reference.py``; the tour's ``--plain``); "torch" (the torch loop,
``rejection_torch.py``) and "triton" (the kernels in ``rejection_kernels.py``, imported when they
first run, so a CPU run never loads Triton) sample the residual by vLLM's exponential race
(``race_random_sample``), so that their ids equal vLLM 0.32's from the same draws; "block"
(``rejection_sample_method="block"``: ``rejection_block.py``) judges each request's drafts jointly. The uniform draws
are made here in torch, once, for every backend. The torch loop writes its output as the article
does (``accept_left_to_right``: per request, left to right, stop at the first rejection), the loop
each program of the Triton kernels runs, and on a CPU it is the fast path.

Before the rule, the target's logits get what plain sampling would apply at each draft's position
(vLLM's ``apply_logits_processors`` and ``apply_sampling_constraints``, below).
"""
from __future__ import annotations

import itertools
import math
import os
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from minivllm import trace
from minivllm.sample import rejection_reference, rejection_torch
from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.sampler import apply_temperature, apply_top_k_top_p

if TYPE_CHECKING:   # annotations only: the drafts' metadata loads with speculative decoding
    from minivllm.sample.spec_decode_metadata import SpecDecodeMetadata

PLACEHOLDER_TOKEN_ID = -1


# ---------------------------------------------------------------------------------------------------
# What plain sampling would apply at each draft's position, and which rows are greedy.

GREEDY_TEMPERATURE = 0.0


def _is_greedy(sampling_metadata: SamplingMetadata, batch_size: int, device) -> torch.Tensor:
    if sampling_metadata.all_greedy or sampling_metadata.all_random:
        return torch.full((batch_size,), sampling_metadata.all_greedy, dtype=torch.bool, device=device)
    return sampling_metadata.temperature == GREEDY_TEMPERATURE


def expand_batch_to_tokens_torch(x, cu_num_tokens, num_tokens, max_spec_len, replace_from=0,
                                 replace_to=0) -> torch.Tensor:
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return x.repeat_interleave(counts, output_size=num_tokens)


def apply_sampling_constraints(logits: torch.Tensor, metadata: SpecDecodeMetadata,
                               sampling_metadata: SamplingMetadata, backend: str = "torch") -> torch.Tensor:
    """Temperature, min_p, top-k and top-p per draft token: each request's values repeated over its
    drafts (vLLM 0.32 leaves min_p out here; applying it keeps every position distributed as the
    plain sampler's)."""
    if sampling_metadata.all_greedy:
        return logits
    expand = expand_batch_to_tokens_torch
    if backend == "triton":
        from minivllm.sample.rejection_kernels import expand_batch_to_tokens_triton as expand
    n, cu, msl = logits.shape[0], metadata.cu_num_draft_tokens, metadata.max_spec_len
    temperature = expand(sampling_metadata.temperature, cu, n, msl, GREEDY_TEMPERATURE, 1.0)
    top_k = None if sampling_metadata.top_k is None else expand(sampling_metadata.top_k, cu, n, msl)
    top_p = None if sampling_metadata.top_p is None else expand(sampling_metadata.top_p, cu, n, msl)
    logits = apply_temperature(logits, temperature)
    if sampling_metadata.min_p is not None:
        from minivllm.sample.ops.builtin import apply_min_p
        logits = apply_min_p(logits, expand(sampling_metadata.min_p, cu, n, msl))
    return apply_top_k_top_p(logits, top_k, top_p)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for ``[n, vocab]``: the same ids (the first index on ties, the
    first NaN if any), computed in chunks on a CPU.

    There ``argmax`` runs one element at a time (measured on 2 cores: 1.1 ms for the 24 rows of an
    8-request verify step over SmolLM2's 49,152 entries), while ``amax`` is vectorised (0.08 ms
    for the 24). So each chunk of ``chunk`` entries gets its maximum, ``argmax`` finds the first
    chunk holding the row's maximum, then runs inside that chunk only: about 3x faster. ``chunk``
    divides the vocabulary; with no divisor of 1024 of at least 64, on a GPU, or for a strided
    tensor, this is ``argmax`` itself."""
    n, vocab = logits.shape
    chunk = math.gcd(vocab, 1024)
    if logits.device.type != "cpu" or chunk < 64 or vocab == chunk or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    chunks = logits.view(n, vocab // chunk, chunk)
    first = chunks.amax(dim=-1).argmax(dim=-1)        # [n]: the first chunk holding the maximum
    return first * chunk + chunks[torch.arange(n, device=logits.device), first].argmax(dim=-1)


def apply_draft_logits_processors(logits: torch.Tensor, sampling_metadata: SamplingMetadata,
                                  metadata: SpecDecodeMetadata) -> torch.Tensor:
    """vLLM's ``RejectionSampler.apply_logits_processors``: the sampler's processors at every
    draft position, the earlier drafts counted as outputs (``ops/processors.py``), when a
    request asked for one."""
    if not sampling_metadata.needs_logits_processors:
        return logits
    from minivllm.sample.ops import processors
    return processors.apply_draft_logits_processors(logits, sampling_metadata, metadata)


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
    """Output ``[batch, max_spec_len + 1]`` int32 and the uniform draws (``None`` if all greedy).
    Greedy rows first, then the random ones, each by ``backend``'s own function."""
    batch_size, device = len(num_draft_tokens), draft_token_ids.device
    output = torch.full((batch_size, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
                        device=device)
    is_greedy = _is_greedy(sampling_metadata, batch_size, device)
    if not sampling_metadata.all_random:
        greedy_args = (output, cu_num_draft_tokens, draft_token_ids, target_argmax,
                       bonus_token_ids, is_greedy, max_spec_len)
        if backend == "reference":
            rejection_reference.rejection_greedy_sample_reference(*greedy_args)
        elif backend in ("torch", "block"):   # a greedy row keeps the argmax's run either way
            rejection_torch.rejection_greedy_sample_torch(*greedy_args)
        else:
            from minivllm.sample import rejection_kernels
            rejection_kernels.rejection_greedy_sample_triton(*greedy_args)
        if sampling_metadata.all_greedy:
            return output, None
    generators = sampling_metadata.generators
    uniform_probs = generate_uniform_probs(draft_token_ids.numel(), num_draft_tokens, generators, device)
    random_args = (output, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs,
                   target_probs, bonus_token_ids, uniform_probs, is_greedy, generators)
    if backend == "reference":   # the article's rule, one request at a time
        rejection_reference.rejection_random_sample_reference(*random_args)
    elif backend == "block":     # block verification (rejection_sample_method="block")
        from minivllm.sample.rejection_block import block_random_sample
        block_random_sample(*random_args)
    elif backend == "torch":     # vLLM's race, in torch
        rejection_torch.race_random_sample(rejection_torch.sample_recovered_tokens_torch,
                                           rejection_torch.rejection_random_sample_torch,
                                           *random_args)
    else:                        # vLLM's race, in the Triton kernels
        from minivllm.sample import rejection_kernels
        rejection_torch.race_random_sample(rejection_kernels.sample_recovered_tokens_triton,
                                           rejection_kernels.rejection_random_sample_triton,
                                           *random_args)
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
        # As vLLM 0.32's rejection_sample: the argmax of the logits only if a row is greedy (the
        # token the Sampler picks; the probs' argmax could differ where softmax rounds), the
        # softmax only if a row is random.
        target_argmax = None if sampling_metadata.all_random else row_argmax(logits)
        target_probs = None if sampling_metadata.all_greedy else logits.softmax(-1, torch.float32)
        output, uniform_probs = rejection_sample(
            metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
            metadata.cu_num_draft_tokens, draft_probs, target_probs, target_argmax, bonus_token_ids,
            sampling_metadata, self.backend)
        if self.record or (trace.active and trace.is_recording()):
            # The model runner turns these into "spec_verify" trace events keyed by request id.
            self.last_record = self.make_record(metadata, sampling_metadata, target_logits,
                                                draft_probs, target_probs, target_argmax,
                                                uniform_probs, output)
        return output

    def make_record(self, metadata: SpecDecodeMetadata, sampling_metadata: SamplingMetadata,
                    target_logits: torch.Tensor, draft_probs: Optional[torch.Tensor],
                    target_probs: Optional[torch.Tensor], target_argmax: Optional[torch.Tensor],
                    uniform_probs: Optional[torch.Tensor], output: torch.Tensor) -> list[list[dict]]:
        """The per-position decisions of one ``forward`` (verify_record.py, which gets this
        sampler's greedy rows, processors and constraints as arguments and never imports it).
        ``target_probs`` / ``target_argmax`` that ``forward`` skipped (no random / no greedy row)
        are computed here from the logits it tested the drafts against."""
        from minivllm.sample.verify_record import build_record
        tested = self.last_target_logits
        if target_probs is None:
            target_probs = tested.softmax(dim=-1, dtype=torch.float32)
        if target_argmax is None:
            target_argmax = row_argmax(tested)
        logits = target_logits.float()
        return build_record(
            metadata, sampling_metadata, target_logits, draft_probs, target_probs, target_argmax,
            uniform_probs, output,
            is_greedy=_is_greedy(sampling_metadata, output.shape[0], output.device),
            processed=apply_draft_logits_processors(logits, sampling_metadata, metadata),
            constrain=lambda x: apply_sampling_constraints(x, metadata, sampling_metadata))

    @staticmethod
    def parse_output(output_token_ids: torch.Tensor, vocab_size: int,
                     discard_req_indices=()) -> list[list[int]]:
        """Each row's valid ids: not the placeholder, inside the vocabulary; discarded rows empty."""
        rows = output_token_ids.tolist()
        discard = set(discard_req_indices)
        return [[] if i in discard else [t for t in row if 0 <= t < vocab_size]
                for i, row in enumerate(rows)]
