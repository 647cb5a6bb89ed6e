"""Verify drafts against the target model, mirroring vllm/v1/sample/rejection_sampler.py.

Article step 7, "accept/reject left to right". ``RejectionSampler(backend)(metadata, draft_probs,
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
on rejection the recovered token is drawn from ``normalize(max(p_target - p_draft, 0))``. Each
output position is then distributed exactly as the target (Leviathan et al. 2023). A draft id of -1
(``PLACEHOLDER_TOKEN_ID``: an async-scheduling placeholder with no real draft behind it, vLLM 0.32's
rejection_sampler.py ``draft_token_id < 0``) is always rejected, on greedy and random rows and in
every backend, and its recovered token comes from ``p_target`` alone; no kernel reads a
probability at index -1.

``rejection_sample`` is vLLM's orchestration: the greedy rows, the uniform draws (made here in
torch, once, for every backend), the random rows. Each path is one call of a backend, chosen by
name when the sampler is built (``REJECTION_BACKENDS``): "reference", the article's rule as it
reads, one request at a time, and the base the others override (rejection_reference.py; the tour's
``--plain``); "torch", vLLM's kernels as torch loops and on a CPU the fast path
(rejection_torch.py); "triton", the kernels themselves (rejection_kernels.py); "block", block
verification (``rejection_sample_method="block"``: rejection_block.py). "torch" and "triton" sample
the residual by vLLM's exponential race, so that their ids equal vLLM 0.32's from the same draws.

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
from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.rejection_reference import ReferenceRejectionBackend
from minivllm.sample.sampler import apply_temperature, apply_top_k_top_p
from minivllm.utils import resolve_obj_by_qualname

if TYPE_CHECKING:   # annotations only
    from minivllm.spec_decode.metadata import SpecDecodeMetadata

PLACEHOLDER_TOKEN_ID = -1

# The backends by name, each a class beside this file; resolved when the sampler is built, so a
# backend is imported only once it is chosen (a CPU run never imports Triton).
REJECTION_BACKENDS: dict[str, str] = {
    "reference": "minivllm.sample.rejection_reference.ReferenceRejectionBackend",
    "torch": "minivllm.sample.rejection_torch.TorchRejectionBackend",
    "triton": "minivllm.sample.rejection_kernels.TritonRejectionBackend",
    "block": "minivllm.sample.rejection_block.BlockRejectionBackend",
}


# ---------------------------------------------------------------------------------------------------
# The inputs against the drafts.

def check_verify_inputs(metadata: SpecDecodeMetadata, draft_probs: Optional[torch.Tensor],
                        target_logits: torch.Tensor, bonus_token_ids: torch.Tensor,
                        sampling_metadata: SamplingMetadata) -> None:
    """``RejectionSampler.forward``'s inputs against ``metadata``'s drafts: one ``target_logits``
    row per draft, ``draft_probs`` (when given) of the same shape, one bonus token and, unless
    every row is greedy, one temperature per request; a ``ValueError`` naming the input otherwise
    (vLLM asserts the shapes)."""
    num_tokens, batch = metadata.draft_token_ids.numel(), len(metadata.num_draft_tokens)
    if target_logits.dim() != 2 or target_logits.shape[0] != num_tokens:
        raise ValueError(f"target_logits must be [num_draft_tokens={num_tokens}, vocab], "
                         f"got {tuple(target_logits.shape)}.")
    if draft_probs is not None and draft_probs.shape != target_logits.shape:
        raise ValueError(f"draft_probs must match target_logits {tuple(target_logits.shape)}, "
                         f"got {tuple(draft_probs.shape)}.")
    if bonus_token_ids.numel() != batch:
        raise ValueError(f"bonus_token_ids must be [batch={batch}, 1], "
                         f"got {tuple(bonus_token_ids.shape)}.")
    temperature = sampling_metadata.temperature
    if not sampling_metadata.all_greedy and (temperature is None or temperature.numel() != batch):
        raise ValueError(f"sampling_metadata.temperature must be [batch={batch}] unless all "
                         f"greedy.")


# ---------------------------------------------------------------------------------------------------
# What plain sampling would apply at each draft's position, and which rows are greedy.

GREEDY_TEMPERATURE = 0.0


def _is_greedy(sampling_metadata: SamplingMetadata, batch_size: int, device) -> torch.Tensor:
    if sampling_metadata.all_greedy or sampling_metadata.all_random:
        return torch.full((batch_size,), sampling_metadata.all_greedy, dtype=torch.bool, device=device)
    return sampling_metadata.temperature == GREEDY_TEMPERATURE


def apply_sampling_constraints(logits: torch.Tensor, metadata: SpecDecodeMetadata,
                               sampling_metadata: SamplingMetadata,
                               backend: type[ReferenceRejectionBackend] = ReferenceRejectionBackend,
                               ) -> torch.Tensor:
    """Temperature, min_p, top-k and top-p per draft token: each request's values repeated over its
    drafts by ``backend.expand_batch_to_tokens`` (vLLM 0.32 leaves min_p out here; applying it
    keeps every position distributed as the plain sampler's)."""
    if sampling_metadata.all_greedy:
        return logits
    expand = backend.expand_batch_to_tokens
    temperature = expand(sampling_metadata.temperature, metadata, GREEDY_TEMPERATURE, 1.0)
    top_k = None if sampling_metadata.top_k is None else expand(sampling_metadata.top_k, metadata)
    top_p = None if sampling_metadata.top_p is None else expand(sampling_metadata.top_p, metadata)
    logits = apply_temperature(logits, temperature)
    if sampling_metadata.min_p is not None:
        from minivllm.sample.ops.builtin import apply_min_p
        logits = apply_min_p(logits, expand(sampling_metadata.min_p, metadata))
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

def rejection_sample(metadata: SpecDecodeMetadata, draft_probs: Optional[torch.Tensor],
                     target_probs: Optional[torch.Tensor], target_argmax: Optional[torch.Tensor],
                     bonus_token_ids: torch.Tensor, sampling_metadata: SamplingMetadata,
                     backend: type[ReferenceRejectionBackend],
                     ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """vLLM's ``rejection_sample``: output ``[batch, max_spec_len + 1]`` int32, and the uniform
    draws ``[num_tokens]`` (``None`` if every row is greedy). ``target_argmax`` ``[num_tokens]``
    (``None`` if no row is greedy) and ``target_probs`` ``[num_tokens, vocab]`` (``None`` if every
    row is greedy). vLLM passes the metadata's fields one by one; here ``backend`` reads from
    ``metadata`` what its rule needs."""
    batch_size, device = len(metadata.num_draft_tokens), metadata.draft_token_ids.device
    output_token_ids = torch.full((batch_size, metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                                  dtype=torch.int32, device=device)
    is_greedy = _is_greedy(sampling_metadata, batch_size, device)
    if not sampling_metadata.all_random:
        # Rejection sampling for greedy sampling requests.
        backend.rejection_greedy_sample(output_token_ids=output_token_ids, metadata=metadata,
                                        target_argmax=target_argmax,
                                        bonus_token_ids=bonus_token_ids, is_greedy=is_greedy)
        if sampling_metadata.all_greedy:
            return output_token_ids, None
    # Generate uniform probabilities for rejection sampling (the random rows').
    uniform_probs = generate_uniform_probs(metadata.draft_token_ids.numel(),
                                           metadata.num_draft_tokens, sampling_metadata.generators,
                                           device)
    # Rejection sampling for random sampling requests: accepted drafts, then a recovered token.
    backend.rejection_random_sample(output_token_ids=output_token_ids, metadata=metadata,
                                    draft_probs=draft_probs, target_probs=target_probs,
                                    bonus_token_ids=bonus_token_ids, uniform_probs=uniform_probs,
                                    is_greedy=is_greedy, generators=sampling_metadata.generators)
    return output_token_ids, uniform_probs


class RejectionSampler(nn.Module):
    """``backend``: a name in ``REJECTION_BACKENDS`` ("reference": the article's rule as it reads;
    "torch"; "triton"; "block": block verification, ``rejection_sample_method="block"``), or
    "auto": ``$MINIVLLM_REJECTION_SAMPLER`` when set (the tour's ``--plain`` sets "reference"), else
    Triton on CUDA and the torch loop otherwise. ``self.backend`` keeps the name, ``self.backend_cls``
    the class ``rejection_sample`` calls.

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
        if backend not in REJECTION_BACKENDS:
            raise ValueError(f"backend must be 'auto', 'torch', 'triton', 'reference' or 'block' "
                             f"(also for MINIVLLM_REJECTION_SAMPLER), got {backend!r}.")
        self.backend = backend
        self.backend_cls: type[ReferenceRejectionBackend] = resolve_obj_by_qualname(
            REJECTION_BACKENDS[backend])
        self.record = False
        self.last_record: Optional[list[list[dict]]] = None
        # The logits each draft was tested against ([num_draft_tokens, vocab], after the logits
        # processors and the sampling constraints), for the logprobs of the accepted tokens.
        self.last_target_logits: Optional[torch.Tensor] = None

    def forward(self, metadata: SpecDecodeMetadata, draft_probs: Optional[torch.Tensor],
                target_logits: torch.Tensor, bonus_token_ids: torch.Tensor,
                sampling_metadata: SamplingMetadata) -> torch.Tensor:
        check_verify_inputs(metadata, draft_probs, target_logits, bonus_token_ids, sampling_metadata)
        if draft_probs is not None:
            draft_probs = draft_probs.float()
        # Penalties, bias, masks and min_tokens on each draft's own output position, the earlier
        # drafts counted as outputs: a draft is tested against what plain sampling would see there.
        logits = apply_draft_logits_processors(target_logits.float(), sampling_metadata, metadata)
        logits = apply_sampling_constraints(logits, metadata, sampling_metadata, self.backend_cls)
        self.last_target_logits = logits
        # As vLLM 0.32's rejection_sample: the argmax of the logits only if a row is greedy (the
        # token the Sampler picks; the probs' argmax could differ where softmax rounds), the
        # softmax only if a row is random.
        target_argmax = None if sampling_metadata.all_random else row_argmax(logits)
        target_probs = None if sampling_metadata.all_greedy else logits.softmax(-1, torch.float32)
        output, uniform_probs = rejection_sample(metadata, draft_probs, target_probs, target_argmax,
                                                 bonus_token_ids, sampling_metadata, self.backend_cls)
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
