"""The article's accept/reject rule, written as the article says it (article step 7, "accept/reject
left to right"; Leviathan et al. 2023, the same rule as gpt-fast's ``speculative_decode``), and
``ReferenceRejectionBackend``: the rejection sampler's ``"reference"`` backend (the tour's
``--plain``: ``MINIVLLM_REJECTION_SAMPLER=reference``), which does one request at a time what the
kernels of vllm/v1/sample/rejection_sampler.py do for a batch, and the base the other backends
override.

Left to right over the drafts: draft ``x`` at position ``j`` is accepted when ``p_draft(x) > 0``
and ``p_target(x) / p_draft(x) >= u``, ``u ~ U[0, 1)``: always when ``p_target(x) >= p_draft(x)``,
else with probability ``p_target(x) / p_draft(x)``; a draft its drafter gave probability 0 is
rejected, as vLLM's kernel rejects it (``draft_prob > 0`` comes first there). At the first
rejection the recovered token is drawn from the residual ``normalize(max(p_target - p_draft, 0))``
and the request stops there; if every draft passed, the bonus token follows the last draft. Each
emitted token is then distributed exactly as the target model's.

The "torch" and "triton" backends compute the same rule for a whole batch so that their ids equal
vLLM 0.32's from the same draws; there the residual is sampled by an exponential race,
``argmax(residual / q)`` with ``q ~ Exp(1)``, which picks token ``t`` with probability
``residual(t) / sum(residual)``: the same distribution as ``torch.multinomial`` on the normalised
residual here. ``block_verify`` is
block verification's rule for one request, beside the article's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:   # annotations only
    from minivllm.spec_decode.metadata import SpecDecodeMetadata


def accept_or_recover(draft_token_ids: list[int], draft_probs: Optional[torch.Tensor],
                      target_probs: torch.Tensor, uniforms: list[float],
                      generator: Optional[torch.Generator] = None) -> tuple[list[int], Optional[int]]:
    """The rule for one request's k drafts -> the accepted drafts, and the recovered token drawn at
    the first rejection (``None`` when every draft passed: the caller adds the bonus token).

    ``draft_probs``: ``[k, vocab]`` the drafter's distributions, or ``None`` for one-hot drafts
    (n-gram: ``p_draft(x) = 1``); ``target_probs``: ``[k, vocab]``, row j the target's distribution
    at draft j's position; ``uniforms``: k draws of U[0, 1). A draft id of -1 (an async-scheduling
    placeholder) drafted nothing: it is rejected and its recovered token comes from ``p_target``."""
    for j, x in enumerate(draft_token_ids):
        if x < 0:                                              # a placeholder drafted nothing
            p_draft = torch.zeros_like(target_probs[j])
        elif draft_probs is None:                              # one-hot: p_draft(x) = 1
            p_draft = torch.nn.functional.one_hot(torch.tensor(x), target_probs.shape[-1])
            p_draft = p_draft.to(target_probs.dtype)
        else:
            p_draft = draft_probs[j]
        if x >= 0:
            p_target_x, p_draft_x = target_probs[j, x].item(), p_draft[x].item()
            if p_draft_x > 0 and p_target_x / p_draft_x >= uniforms[j]:
                continue                                       # accepted: on to the next draft
        residual = (target_probs[j] - p_draft).clamp_min(0.0)
        recovered = torch.multinomial(residual / residual.sum(), 1, generator=generator)
        return draft_token_ids[:j], int(recovered)
    return list(draft_token_ids), None


def rejection_sample_one(draft_token_ids: list[int], draft_probs: Optional[torch.Tensor],
                         target_probs: torch.Tensor,
                         generator: Optional[torch.Generator] = None) -> list[int]:
    """One request's verify step with its own draws. ``target_probs``: ``[k + 1, vocab]``, row k
    the target's distribution after the last draft. -> the accepted drafts, then one recovered or
    bonus token."""
    k = len(draft_token_ids)
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64).tolist()
    accepted, recovered = accept_or_recover(draft_token_ids, draft_probs, target_probs[:k], uniforms,
                                            generator)
    if recovered is None:                                      # every draft passed: the bonus
        recovered = int(torch.multinomial(target_probs[k], 1, generator=generator))
    return accepted + [recovered]


class ReferenceRejectionBackend:
    """The ``"reference"`` backend (the tour's ``--plain``): the article's rule one request at a
    time, and the base the other backends override, each in a file of its own: "torch"
    (rejection_torch.py), "triton" (rejection_kernels.py), "block" (rejection_block.py). As vLLM's
    ``CustomOp.forward_native`` is the plain PyTorch its platform paths replace, a backend
    overrides what it does faster or by another rule and inherits the rest.

    ``rejection_sample`` (rejection_sampler.py) calls each path once, with keyword arguments, and
    ``apply_sampling_constraints`` calls ``expand_batch_to_tokens``. Every method reads the drafts'
    layout from ``metadata`` (``SpecDecodeMetadata``: ``draft_token_ids`` ``[num_tokens]``,
    ``num_draft_tokens``, ``cu_num_draft_tokens`` ``[batch]``, ``max_spec_len``), where vLLM's
    kernels take those fields one by one. ``output_token_ids`` ``[batch, max_spec_len + 1]`` int32,
    pre-filled with -1, is written in place; ``is_greedy`` ``[batch]`` bool says which rows each
    path writes."""

    @staticmethod
    def expand_batch_to_tokens(x: torch.Tensor, metadata: SpecDecodeMetadata, replace_from=0,
                               replace_to=0) -> torch.Tensor:
        """vLLM's ``expand_batch_to_tokens``: ``x`` ``[batch, ...]`` -> ``[num_tokens, ...]``, each
        request's row repeated over its drafts (``x = [a, b, c]``, ``cu_num_draft_tokens = [2, 5,
        6]`` -> ``[a, a, b, b, b, c]``), ``replace_from`` swapped for ``replace_to`` (temperature 0
        -> 1)."""
        cu_num_tokens = metadata.cu_num_draft_tokens
        if replace_from != replace_to:
            x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))
        return x.repeat_interleave(counts, dim=0, output_size=metadata.draft_token_ids.numel())

    @staticmethod
    def rejection_greedy_sample(*, output_token_ids: torch.Tensor, metadata: SpecDecodeMetadata,
                                target_argmax: torch.Tensor, bonus_token_ids: torch.Tensor,
                                is_greedy: torch.Tensor) -> None:
        """The greedy rows, one request at a time: a draft is accepted while it is the target's
        argmax (``target_argmax`` ``[num_tokens]``); at the first mismatch the argmax is output
        instead (it counts as the recovered token); if every draft passed, the bonus
        (``bonus_token_ids`` ``[batch, 1]``) follows. A -1 placeholder never matches."""
        cu, start = metadata.cu_num_draft_tokens.tolist(), 0
        for i, (end, greedy) in enumerate(zip(cu, is_greedy.tolist())):
            if greedy:
                out = []
                for draft, argmax in zip(metadata.draft_token_ids[start:end].tolist(),
                                         target_argmax[start:end].tolist()):
                    out.append(argmax)
                    if draft != argmax:
                        break
                else:
                    out.append(int(bonus_token_ids[i]))
                output_token_ids[i, :len(out)] = torch.tensor(out, dtype=torch.int32)
            start = end

    @staticmethod
    def rejection_random_sample(*, output_token_ids: torch.Tensor, metadata: SpecDecodeMetadata,
                                draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                                bonus_token_ids: torch.Tensor, uniform_probs: torch.Tensor,
                                is_greedy: torch.Tensor,
                                generators: dict[int, torch.Generator]) -> None:
        """The random rows, one request at a time by ``accept_or_recover``, with the rejection
        sampler's uniform draws ``uniform_probs`` ``[num_tokens]`` (the tour's spec.7 shows them);
        a seeded request (its row in ``generators``) draws its recovered token with its own
        generator. ``draft_probs`` (``None``: one-hot drafts) and ``target_probs`` ``[num_tokens,
        vocab]``."""
        cu, start = metadata.cu_num_draft_tokens.tolist(), 0
        for i, (end, greedy) in enumerate(zip(cu, is_greedy.tolist())):
            if not greedy:
                drafts = metadata.draft_token_ids[start:end].tolist()
                accepted, recovered = accept_or_recover(
                    drafts, None if draft_probs is None else draft_probs[start:end],
                    target_probs[start:end], uniform_probs[start:end].tolist(), generators.get(i))
                out = accepted + [int(bonus_token_ids[i]) if recovered is None else recovered]
                output_token_ids[i, :len(out)] = torch.tensor(out, dtype=torch.int32)
            start = end


def block_verify(draft_token_ids: list[int], draft_probs: Optional[torch.Tensor],
                 target_probs: torch.Tensor, uniforms: list[float],
                 generator: Optional[torch.Generator] = None) -> tuple[list[int], Optional[int]]:
    """Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding",
    Algorithm 2; vLLM 0.32's ``rejection_sample_method="block"``) for one request's k drafts, with
    ``accept_or_recover``'s arguments and result. The block is judged jointly: ``p_i``, the joint
    ratio of the first i drafts capped at 1, says how much of the prefix the target would have
    produced; ``h_i`` weighs keeping that prefix against the mass the residual could still give
    after it. The longest prefix whose draw passes is kept (no stop at the first failure), then one
    token from the residual after it. Averaged over drafts drawn from the drafter it keeps at
    least as many tokens as the token-wise rule, and each output is distributed as the target's.

    Worked example (vocabulary {a, b}, drafts ``a a``, uniforms 0.7 then 0.6):
    position 1: ``q = (a .8, b .2)``, ``p = (a .4, b .6)``; position 2: ``q = (a .5, b .5)``,
    ``p = (a .9, b .1)``. Token-wise: ``.4 / .8 = .5 < .7``, the first draft is rejected and b is
    drawn from ``max(p - q, 0) = (0, .4)``: 1 token. Block: ``p_1 = .5``, ``p_2 = min(.5 * .9 / .5,
    1) = .9``; the mass after ``a`` is ``sum max(.5 * p - q, 0) = 0``, so ``h_1 = 0`` (0.7 fails),
    and ``h_2 = p_2 = .9`` (0.6 passes): both drafts are kept and the bonus follows: 3 tokens."""
    k = len(draft_token_ids)

    def q(j: int) -> torch.Tensor:   # the drafter's row j; a one-hot draft's is its token
        if draft_probs is not None:
            return draft_probs[j]
        return torch.zeros_like(target_probs[j]).index_fill_(0, torch.tensor(draft_token_ids[j]), 1.0)
    p = [1.0]                        # p[i]: the first i drafts' joint ratio target/drafter, <= 1
    tau = 0                          # how many drafts are kept
    for i in range(1, k + 1):
        x = draft_token_ids[i - 1]
        if x < 0:                    # a placeholder drafted nothing: the block ends before it
            break
        q_x = q(i - 1)[x].item()
        p.append(min(p[i - 1] * target_probs[i - 1, x].item() / q_x, 1.0) if q_x > 0 else 0.0)
        if i < k and draft_token_ids[i] >= 0:   # what the residual after x_<=i could still give
            residual_mass = (p[i] * target_probs[i] - q(i)).clamp_min(0.0).sum().item()
            h = residual_mass / (residual_mass + 1.0 - p[i]) if residual_mass + 1.0 - p[i] > 0 else 1.0
        else:                        # the last draft: keep the whole block with probability p_k
            h = p[i]
        if uniforms[i - 1] <= h:
            tau = i                  # the longest passing prefix wins, not the first failure
    if tau == k:
        return list(draft_token_ids), None
    residual = target_probs[tau] if draft_token_ids[tau] < 0 else \
        (p[tau] * target_probs[tau] - q(tau)).clamp_min(0.0)
    recovered = torch.multinomial(residual / residual.sum(), 1, generator=generator)
    return draft_token_ids[:tau], int(recovered)
