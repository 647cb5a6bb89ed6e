"""The rejection sampler's "triton" backend, ``TritonRejectionBackend``: the Triton kernels of
vllm/v1/sample/rejection_sampler.py (article step 7, "accept/reject left to right"), overriding all
three methods of ``ReferenceRejectionBackend`` (rejection_reference.py). Each kernel writes the same
numbers as its torch twin in rejection_torch.py given the same inputs, the random draws included,
which are made once in torch beforehand (``generate_uniform_probs``, ``generate_recovery_noise``).

Shapes: ``batch`` requests, ``num_tokens`` drafts in all, ``vocab`` entries.
- ``output_token_ids`` ``[batch, max_spec_len + 1]`` int32, pre-filled with -1, written in place
- ``cu_num_draft_tokens`` ``[batch]`` int32 inclusive cumsum; ``draft_token_ids`` ``[num_tokens]`` int32
- ``draft_probs`` ``[num_tokens, vocab]`` float32 or ``None`` (one-hot drafts); ``target_probs`` the same
- ``bonus_token_ids`` ``[batch, 1]``; ``uniform_probs`` ``[num_tokens]`` float64
- ``q`` ``[batch, vocab]`` float32 Exp(1) noise, one row per request
- ``is_greedy`` ``[batch]`` bool: the greedy kernel handles these rows, the random kernel the others
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from minivllm.sample.rejection_reference import ReferenceRejectionBackend
from minivllm.sample.rejection_torch import generate_recovery_noise
from minivllm.triton_utils import KernelLaunch, tl, triton

if TYPE_CHECKING:   # annotations only
    from minivllm.spec_decode.metadata import SpecDecodeMetadata

_MAX_VOCAB_BLOCK = 4096


@triton.jit
def _request_range(cu_num_draft_tokens_ptr, req_idx):
    # Requests' drafts are contiguous; cu_num_draft_tokens has no leading 0, hence the masked load.
    start_idx = tl.load(cu_num_draft_tokens_ptr + req_idx - 1, mask=req_idx > 0, other=0)
    end_idx = tl.load(cu_num_draft_tokens_ptr + req_idx)
    return start_idx, end_idx - start_idx


@triton.jit
def rejection_greedy_sample_kernel(
    output_token_ids_ptr, cu_num_draft_tokens_ptr, draft_token_ids_ptr, target_argmax_ptr,
    bonus_token_ids_ptr, is_greedy_ptr, max_spec_len,
):
    # One program per request. Article step: accept drafts left to right while they equal the target's
    # argmax; the argmax at the first mismatch is the output there (it is the "recovered" token).
    req_idx = tl.program_id(0)
    is_greedy = tl.load(is_greedy_ptr + req_idx)
    if is_greedy:
        start_idx, num_draft = _request_range(cu_num_draft_tokens_ptr, req_idx)
        out_row = output_token_ids_ptr + req_idx * (max_spec_len + 1)
        rejected = False
        for pos in range(num_draft):
            if not rejected:
                draft_id = tl.load(draft_token_ids_ptr + start_idx + pos)
                target_id = tl.load(target_argmax_ptr + start_idx + pos)
                tl.store(out_row + pos, target_id)
                rejected = draft_id != target_id
        if not rejected:
            tl.store(out_row + num_draft, tl.load(bonus_token_ids_ptr + req_idx))


@triton.jit
def rejection_random_sample_kernel(
    output_token_ids_ptr, cu_num_draft_tokens_ptr, draft_token_ids_ptr, draft_probs_ptr,
    target_probs_ptr, bonus_token_ids_ptr, recovered_token_ids_ptr, uniform_probs_ptr,
    is_greedy_ptr, max_spec_len, vocab_size, NO_DRAFT_PROBS: tl.constexpr,
):
    # One program per request: accept draft x with probability min(1, p_target(x) / p_draft(x)).
    req_idx = tl.program_id(0)
    is_greedy = tl.load(is_greedy_ptr + req_idx)
    if not is_greedy:
        start_idx, num_draft = _request_range(cu_num_draft_tokens_ptr, req_idx)
        out_row = output_token_ids_ptr + req_idx * (max_spec_len + 1)
        rejected = False
        for pos in range(num_draft):
            if not rejected:
                token_idx = start_idx + pos
                draft_id = tl.load(draft_token_ids_ptr + token_idx)
                # A -1 placeholder is rejected; its probabilities are never read.
                real = draft_id >= 0
                prob_offset = token_idx.to(tl.int64) * vocab_size + tl.maximum(draft_id, 0)
                target_prob = tl.load(target_probs_ptr + prob_offset, mask=real, other=0.0)
                uniform = tl.load(uniform_probs_ptr + token_idx)
                if NO_DRAFT_PROBS:
                    # A one-hot draft has p_draft = 1: accept with probability p_target(draft).
                    accept = real & (target_prob >= uniform)
                else:
                    draft_prob = tl.load(draft_probs_ptr + prob_offset, mask=real, other=0.0)
                    # IEEE division so that compiled kernels match the torch reference bit for bit.
                    accept = real & (draft_prob > 0) & (
                        tl.div_rn(target_prob, tl.where(real, draft_prob, 1.0)) >= uniform)
                if accept:
                    token_id = draft_id
                else:
                    rejected = True
                    token_id = tl.load(recovered_token_ids_ptr + token_idx)
                tl.store(out_row + pos, token_id)
        if not rejected:
            tl.store(out_row + num_draft, tl.load(bonus_token_ids_ptr + req_idx))


@triton.jit
def sample_recovered_tokens_kernel(
    recovered_token_ids_ptr, cu_num_draft_tokens_ptr, draft_token_ids_ptr, draft_probs_ptr,
    target_probs_ptr, q_ptr, vocab_size, BLOCK_SIZE: tl.constexpr, NO_DRAFT_PROBS: tl.constexpr,
):
    # Grid (batch, max_spec_len). Samples from the residual max(p_target - p_draft, 0) (or p_target
    # with the draft removed, for one-hot drafts) by argmax(prob / q), q ~ Exp(1) shared by the request.
    req_idx = tl.program_id(0)
    pos = tl.program_id(1)
    start_idx, num_draft = _request_range(cu_num_draft_tokens_ptr, req_idx)
    if pos < num_draft:
        token_idx = start_idx + pos
        draft_id = tl.load(draft_token_ids_ptr + token_idx)
        row = token_idx.to(tl.int64) * vocab_size
        q_row = req_idx.to(tl.int64) * vocab_size
        best_score = tl.full((), -1.0, tl.float32)
        best_id = tl.full((), 0, tl.int32)
        # The vocabulary in blocks; a later block wins only if strictly better: first index on ties.
        for block_start in range(0, vocab_size, BLOCK_SIZE):
            cols = block_start + tl.arange(0, BLOCK_SIZE)
            mask = cols < vocab_size
            prob = tl.load(target_probs_ptr + row + cols, mask=mask, other=0.0)
            if NO_DRAFT_PROBS:
                prob = tl.where(cols == draft_id, 0.0, prob)   # never true for a -1 placeholder
            else:
                draft_prob = tl.load(draft_probs_ptr + row + cols, mask=mask, other=0.0)
                # A -1 placeholder drafted nothing: recover from p_target itself.
                prob = tl.where(draft_id >= 0, tl.maximum(prob - draft_prob, 0.0), prob)
            q = tl.load(q_ptr + q_row + cols, mask=mask, other=1.0)
            score = tl.where(mask, tl.div_rn(prob, q), -1.0)
            block_best = tl.max(score, axis=0)
            block_id = tl.argmax(score, axis=0).to(tl.int32) + block_start
            best_id = tl.where(block_best > best_score, block_id, best_id)
            best_score = tl.maximum(block_best, best_score)
        tl.store(recovered_token_ids_ptr + token_idx, best_id)


@triton.jit
def expand_kernel(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to,
                  MAX_NUM_TOKENS: tl.constexpr):
    # One program per request: copy its value to each of its tokens (a, b, c with cumulative counts
    # 2, 5, 6 give a a b b b c), swapping replace_from for replace_to (temperature 0 -> 1).
    req_idx = tl.program_id(0)
    start_idx, num_tokens = _request_range(cu_num_tokens_ptr, req_idx)
    value = tl.load(input_ptr + req_idx)
    value = tl.where(value == replace_from, replace_to, value)
    offsets = tl.arange(0, MAX_NUM_TOKENS)
    tl.store(output_ptr + start_idx + offsets, value, mask=offsets < num_tokens)


# ----------------------------------------------------------------------------------------------------
def _probs_or_dummy(draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor) -> torch.Tensor:
    # With NO_DRAFT_PROBS the pointer is never read; any tensor on the right device will do.
    return target_probs if draft_probs is None else draft_probs.contiguous()


# Each ``*_launch`` maps inputs to one ``KernelLaunch`` (grid, arguments, constexprs); the launcher
# runs it and ``minivllm.bench.triton_aot`` compiles the same launch for GPU targets ahead of time.

def expand_launch(output, x, cu_num_tokens, max_spec_len, replace_from=0,
                  replace_to=0) -> KernelLaunch:
    return KernelLaunch(
        expand_kernel, (x.shape[0],),
        dict(output_ptr=output, input_ptr=x, cu_num_tokens_ptr=cu_num_tokens,
             replace_from=replace_from, replace_to=replace_to),
        dict(MAX_NUM_TOKENS=triton.next_power_of_2(max_spec_len)))


def rejection_greedy_sample_launch(output_token_ids, cu_num_draft_tokens, draft_token_ids,
                                   target_argmax, bonus_token_ids, is_greedy,
                                   max_spec_len) -> KernelLaunch:
    return KernelLaunch(
        rejection_greedy_sample_kernel, (output_token_ids.shape[0],),
        dict(output_token_ids_ptr=output_token_ids, cu_num_draft_tokens_ptr=cu_num_draft_tokens,
             draft_token_ids_ptr=draft_token_ids, target_argmax_ptr=target_argmax.to(torch.int32),
             bonus_token_ids_ptr=bonus_token_ids.to(torch.int32).contiguous(),
             is_greedy_ptr=is_greedy, max_spec_len=max_spec_len), {})


def rejection_random_sample_launch(output_token_ids, cu_num_draft_tokens, draft_token_ids,
                                   draft_probs, target_probs, bonus_token_ids, recovered_token_ids,
                                   uniform_probs, is_greedy, max_spec_len) -> KernelLaunch:
    target_probs = target_probs.contiguous()
    return KernelLaunch(
        rejection_random_sample_kernel, (output_token_ids.shape[0],),
        dict(output_token_ids_ptr=output_token_ids, cu_num_draft_tokens_ptr=cu_num_draft_tokens,
             draft_token_ids_ptr=draft_token_ids,
             draft_probs_ptr=_probs_or_dummy(draft_probs, target_probs),
             target_probs_ptr=target_probs,
             bonus_token_ids_ptr=bonus_token_ids.to(torch.int32).contiguous(),
             recovered_token_ids_ptr=recovered_token_ids, uniform_probs_ptr=uniform_probs,
             is_greedy_ptr=is_greedy, max_spec_len=max_spec_len,
             vocab_size=target_probs.shape[-1]),
        dict(NO_DRAFT_PROBS=draft_probs is None))


def sample_recovered_tokens_launch(recovered, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                   target_probs, q, max_spec_len) -> KernelLaunch:
    target_probs = target_probs.contiguous()
    vocab_size = target_probs.shape[-1]
    return KernelLaunch(
        sample_recovered_tokens_kernel, (cu_num_draft_tokens.shape[0], max_spec_len),
        dict(recovered_token_ids_ptr=recovered, cu_num_draft_tokens_ptr=cu_num_draft_tokens,
             draft_token_ids_ptr=draft_token_ids,
             draft_probs_ptr=_probs_or_dummy(draft_probs, target_probs),
             target_probs_ptr=target_probs, q_ptr=q.contiguous(), vocab_size=vocab_size),
        dict(BLOCK_SIZE=min(triton.next_power_of_2(vocab_size), _MAX_VOCAB_BLOCK),
             NO_DRAFT_PROBS=draft_probs is None))


def sample_recovered_tokens_triton(cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs,
                                   q, max_spec_len) -> torch.Tensor:
    """Each draft's recovered token ``[num_tokens]``, as rejection_torch.py's
    ``sample_recovered_tokens_torch`` draws it from ``q`` expanded over the drafts; here ``q``
    ``[batch, vocab]``, one row per request, and the grid ``(batch, max_spec_len)``."""
    recovered = torch.empty_like(draft_token_ids)
    if draft_token_ids.numel() == 0:
        return recovered
    sample_recovered_tokens_launch(recovered, cu_num_draft_tokens, draft_token_ids, draft_probs,
                                   target_probs, q, max_spec_len).run()
    return recovered


class TritonRejectionBackend(ReferenceRejectionBackend):
    """``"triton"``: vLLM's kernels, launched as its ``rejection_sample`` launches them."""

    @staticmethod
    def expand_batch_to_tokens(x: torch.Tensor, metadata: SpecDecodeMetadata, replace_from=0,
                               replace_to=0) -> torch.Tensor:
        """``expand_kernel``, one program per request; ``max_spec_len`` sizes its block."""
        num_tokens = metadata.draft_token_ids.numel()
        output = torch.empty(num_tokens, dtype=x.dtype, device=x.device)
        if num_tokens > 0:
            expand_launch(output, x, metadata.cu_num_draft_tokens, metadata.max_spec_len,
                          replace_from, replace_to).run()
        return output

    @staticmethod
    def rejection_greedy_sample(*, output_token_ids: torch.Tensor, metadata: SpecDecodeMetadata,
                                target_argmax: torch.Tensor, bonus_token_ids: torch.Tensor,
                                is_greedy: torch.Tensor) -> None:
        """``rejection_greedy_sample_kernel``, one program per request."""
        rejection_greedy_sample_launch(
            output_token_ids=output_token_ids, cu_num_draft_tokens=metadata.cu_num_draft_tokens,
            draft_token_ids=metadata.draft_token_ids, target_argmax=target_argmax,
            bonus_token_ids=bonus_token_ids, is_greedy=is_greedy,
            max_spec_len=metadata.max_spec_len).run()

    @staticmethod
    def rejection_random_sample(*, output_token_ids: torch.Tensor, metadata: SpecDecodeMetadata,
                                draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                                bonus_token_ids: torch.Tensor, uniform_probs: torch.Tensor,
                                is_greedy: torch.Tensor,
                                generators: dict[int, torch.Generator]) -> None:
        """vLLM's race, as the "torch" backend runs it: the recovered tokens up front
        (``sample_recovered_tokens_kernel``), then ``rejection_random_sample_kernel``."""
        num_draft_tokens = metadata.num_draft_tokens
        q = generate_recovery_noise(len(num_draft_tokens), target_probs.shape[-1], num_draft_tokens,
                                    generators, target_probs.device)
        recovered_token_ids = sample_recovered_tokens_triton(
            cu_num_draft_tokens=metadata.cu_num_draft_tokens,
            draft_token_ids=metadata.draft_token_ids, draft_probs=draft_probs,
            target_probs=target_probs, q=q, max_spec_len=metadata.max_spec_len)
        rejection_random_sample_launch(
            output_token_ids=output_token_ids, cu_num_draft_tokens=metadata.cu_num_draft_tokens,
            draft_token_ids=metadata.draft_token_ids, draft_probs=draft_probs,
            target_probs=target_probs, bonus_token_ids=bonus_token_ids,
            recovered_token_ids=recovered_token_ids, uniform_probs=uniform_probs,
            is_greedy=is_greedy, max_spec_len=metadata.max_spec_len).run()
