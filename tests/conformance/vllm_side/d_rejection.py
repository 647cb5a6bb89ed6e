"""Case d, vLLM side: vLLM's rejection sampler (``v1/sample/rejection_sampler.py``) on the test's
batches, with the kernels the CPU build runs (the C++ overrides ``CpuPlatform`` registers for the
Triton kernels, as ``worker_base.py`` does at start). No engine.

Input: ``{"cases": [{"drafts": [[ids] per request], "target_logits": [num_tokens][V],
"bonus_logits": [batch][V], "bonus_token_ids": [batch], "draft_probs": [num_tokens][V] | None,
"temperature": [batch] (0 = greedy), "seeds": [batch] (None on greedy rows)}]}``.
Output per case:
- ``rejection_sample``: ``[batch][max_spec_len + 1]`` from ``rejection_sample(...)`` after
  ``apply_sampling_constraints``: the call minivllm's ``RejectionSampler.forward`` mirrors (bonus
  ids given), with fresh ``torch.Generator(seed)`` per seeded row;
- ``forward``: the same from ``RejectionSampler(Sampler()).forward(metadata, draft_probs, logits
  [num_tokens + batch, V], sampling_metadata)``, vLLM 0.32's call shape, which samples the bonus
  itself (fresh generators again), and ``forward_bonus``, the bonus ids it drew.
Both run with ``expand_kernel`` computed in torch: the CPU build's override of that kernel is
broken (``expand_kernel_check``, reported under ``"expand_kernel"``).
"""
import torch
from common import Timer, read_input, write_output
from vllm.platforms import current_platform
from vllm.v1.sample import rejection_sampler as rs
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import (RejectionSampler, apply_sampling_constraints,
                                              rejection_sample)
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata


def sampling_metadata(case) -> SamplingMetadata:
    temps = case["temperature"]
    batch = len(temps)
    greedy = [t == 0 for t in temps]
    gens = {i: torch.Generator().manual_seed(s) for i, s in enumerate(case["seeds"])
            if s is not None and not greedy[i]}
    return SamplingMetadata(
        temperature=None if all(greedy) else torch.tensor(temps, dtype=torch.float32),
        all_greedy=all(greedy), all_random=not any(greedy), top_p=None, top_k=None,
        generators=gens, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
        spec_token_ids=case["drafts"])


def metadata(drafts: list[list[int]]) -> SpecDecodeMetadata:
    """As ``_calc_spec_decode_metadata`` lays logits out: per request its draft rows, then its
    bonus row (``make_dummy`` leaves the index tensors zero)."""
    md = SpecDecodeMetadata.make_dummy(drafts, device=torch.device("cpu"))
    target_idx, bonus_idx, start = [], [], 0
    for row in drafts:
        target_idx += range(start, start + len(row))
        bonus_idx.append(start + len(row))
        start += len(row) + 1
    md.target_logits_indices = torch.tensor(target_idx, dtype=torch.int32)
    md.bonus_logits_indices = torch.tensor(bonus_idx, dtype=torch.int32)
    md.logits_indices = torch.arange(start, dtype=torch.int32)
    return md


def run_case(case, sampler) -> dict:
    md = metadata(case["drafts"])
    target = torch.tensor(case["target_logits"], dtype=torch.float32)
    bonus_logits = torch.tensor(case["bonus_logits"], dtype=torch.float32)
    draft_probs = (None if case["draft_probs"] is None
                   else torch.tensor(case["draft_probs"], dtype=torch.float32))
    sm = sampling_metadata(case)
    logits = apply_sampling_constraints(target.clone(), md.cu_num_draft_tokens, sm)
    bonus = torch.tensor(case["bonus_token_ids"], dtype=torch.int32).view(-1, 1)
    rs = rejection_sample(md.draft_token_ids, md.num_draft_tokens, md.max_spec_len,
                          md.cu_num_draft_tokens, draft_probs, logits, bonus, sm)
    # The full forward: logits rows in the runner's layout, each request's drafts then its bonus.
    full = torch.empty(target.shape[0] + bonus_logits.shape[0], target.shape[1])
    full[md.target_logits_indices.long()] = target
    full[md.bonus_logits_indices.long()] = bonus_logits
    out = sampler(md, draft_probs, full, sampling_metadata(case))
    # The bonus ids that forward sampled (its Sampler on the bonus rows, fresh generators again).
    bonus_out = sampler.sampler(logits=bonus_logits.clone(), sampling_metadata=sampling_metadata(
        case), predict_bonus_token=True).sampled_token_ids
    return {"rejection_sample": rs.tolist(), "forward": out.sampled_token_ids.tolist(),
            "forward_bonus": bonus_out.view(-1).tolist()}


def expand_kernel_check() -> dict:
    """vLLM 0.32's CPU override of ``expand_kernel`` (``utils/cpu_triton_utils.py``
    ``_expand_kernel_impl``) passes ``_ensure_int64(output)`` to the C++ op: for a float32 output
    (temperatures, top-p) that is a temporary int64 copy, so the real output is never written and
    ``expand_batch_to_tokens`` returns ``new_empty`` memory. Shown here with a sentinel-filled
    output; int64 inputs (top-k) are expanded correctly."""
    cu = torch.tensor([2, 3, 5], dtype=torch.int32)
    out_f = torch.full((5,), -7.0)
    rs._expand(out_f, torch.tensor([0.5, 0.0, 1.5]), cu, 0, 1)
    out_i = torch.full((5,), -7, dtype=torch.int64)
    rs._expand(out_i, torch.tensor([3, 0, 9]), cu, 0, 1)
    return {"float32": out_f.tolist(), "int64": out_i.tolist()}


def _expand_torch(output, x, cu_num_tokens, replace_from, replace_to, **_):
    """The expansion the Triton ``expand_kernel`` computes, used instead of the broken CPU
    override so the rest of vLLM's sampler can be compared (see ``expand_kernel_check``)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    output.copy_(x.repeat_interleave(counts, output_size=output.shape[0]))


if __name__ == "__main__":
    cases = read_input()["cases"]
    timer = Timer()
    current_platform.register_triton_kernel_overrides()
    expand = expand_kernel_check()
    sampler = RejectionSampler(Sampler())     # (registers its kernels' warm-up first)
    rs._expand = _expand_torch
    write_output({"cases": [run_case(c, sampler) for c in cases], "expand_kernel": expand,
                  "seconds": timer()})
