"""The model runner's sampling, mirroring the middle of vLLM 0.32's ``sample_tokens``
(vllm/v1/worker/gpu_model_runner.py): the batch's ``SamplingMetadata``, then regular sampling or,
when drafts were scheduled, the rejection sampler (article step 7), then the sampled tokens into
the persistent batch (``_bookkeeping_sync``). A mixin of ``ModelRunner`` (model_runner.py), whose
``sample_tokens`` calls these in order; what it uses of the runner is declared below.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from minivllm import trace
from minivllm.sample.metadata import SamplingMetadata
from minivllm.worker.outputs import ExecuteModelState

if TYPE_CHECKING:
    from minivllm.sample.rejection_sampler import RejectionSampler
    from minivllm.sample.sampler import Sampler
    from minivllm.spec_decode.metadata import SpecDecodeMetadata
    from minivllm.worker.input_batch import CachedRequestState, InputBatch


class SamplingMixin:
    # The runner's state this mixin uses (set in ModelRunner.__init__).
    device: torch.device
    max_model_len: int
    input_batch: InputBatch
    requests: dict[str, CachedRequestState]
    sampler: Sampler
    rejection_sampler: Optional[RejectionSampler]
    # This step's logprob rows ``[S, vocab]`` and where each request's tokens start, when a
    # request asked for logprobs (the numbers are gathered in worker/logprobs.py).
    _logprobs_rows: Optional[tuple[torch.Tensor, list[int]]] = None
    _prompt_logprobs_progress: Optional[dict[str, Any]] = None   # the same, per prompt

    def _logprobs_outputs(self, sampled_token_ids: list[list[int]],
                          state: ExecuteModelState) -> dict[str, Any]:
        """``ModelRunnerOutput``'s ``logprobs`` and ``prompt_logprobs_dict`` when a request asked
        for either (worker/logprobs.py); nothing otherwise."""
        params = self.input_batch.sampling_params
        if (self._logprobs_rows is None and not self._prompt_logprobs_progress
                and all(params[r].prompt_logprobs is None for r in self.input_batch.req_ids)):
            return {}
        from minivllm.worker.logprobs import logprobs_outputs
        return logprobs_outputs(self, sampled_token_ids, state)

    def _prepare_sampling(self, seq_lens: np.ndarray) -> tuple[SamplingMetadata, np.ndarray]:
        """-> the batch's ``SamplingMetadata`` and ``partial`` ``[n]``: rows that are a partial
        prefill chunk (they sample nothing; their generator is left out so the discarded draw
        does not shift a seeded request's random stream)."""
        batch = self.input_batch
        partial = seq_lens < batch.num_tokens[:batch.num_reqs]
        generators = {i: g for i, g in batch.generators.items() if not partial[i]}
        params = [batch.sampling_params[r] for r in batch.req_ids]
        states = [self.requests[r] for r in batch.req_ids]
        return SamplingMetadata.from_params(
            params, generators, self.device,
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            spec_token_ids=[batch.spec_token_ids.get(r, []) for r in batch.req_ids],
        ), partial

    def _sample(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata,
                partial: np.ndarray) -> list[list[int]]:
        """Regular sampling, one token per request from ``logits`` ``[n, vocab]`` ([] for a
        partial prefill chunk)."""
        out = self.sampler.sample_output(logits, sampling_metadata)
        if out.logprobs is not None:
            self._logprobs_rows = (out.logprobs, list(range(len(partial))))
        return [[] if partial[i] else [t] for i, t in enumerate(out.sampled_token_ids.tolist())]

    def _rejection_sample(self, spec_md: SpecDecodeMetadata, logits: torch.Tensor,
                          sampling_metadata: SamplingMetadata,
                          partial: np.ndarray) -> list[list[int]]:
        """Article step 7: the rejection sampler instead of regular sampling. ``logits`` ``[S,
        vocab]`` are the rows of ``spec_md.logits_indices``. -> per request the accepted drafts
        and one recovered or bonus token ([] for a partial prefill chunk)."""
        bonus = self.sampler.sample_output(logits[spec_md.bonus_logits_indices], sampling_metadata,
                                           num_draft_tokens=spec_md.num_draft_tokens)
        out = self.rejection_sampler(spec_md, self._scheduled_draft_probs(spec_md),
                                     logits[spec_md.target_logits_indices],
                                     bonus.sampled_token_ids.view(-1, 1).to(torch.int32),
                                     sampling_metadata)
        if bonus.logprobs is not None:   # a request asked for logprobs
            from minivllm.worker.logprobs import spec_logprobs_rows
            self._logprobs_rows = spec_logprobs_rows(self, spec_md, logits, bonus.logprobs)
        if trace.is_recording() and self.rejection_sampler.last_record is not None:
            for i, rec in enumerate(self.rejection_sampler.last_record):
                if spec_md.num_draft_tokens[i]:
                    trace.record("spec_verify", req_id=self.input_batch.req_ids[i], positions=rec)
        return self.rejection_sampler.parse_output(
            out, logits.shape[-1], discard_req_indices=partial.nonzero()[0].tolist())

    def _scheduled_draft_probs(self, spec_md: SpecDecodeMetadata) -> Optional[torch.Tensor]:
        """``draft_probs`` for the rejection sampler: ``None``, the drafts are one-hot (n-gram and
        greedy drafters: ``p_draft = 1``)."""
        return None

    def _bookkeeping_sync(self, sampled_token_ids: list[list[int]]) -> None:
        """Append the sampled tokens to the persistent batch and to each request's state."""
        batch = self.input_batch
        for i, req_id in enumerate(batch.req_ids):
            toks = sampled_token_ids[i]
            if not toks:
                continue
            start = batch.num_tokens_no_spec[i]
            end = min(start + len(toks), self.max_model_len)
            batch.token_ids_cpu[i, start:end] = toks[:end - start]
            batch.num_tokens_no_spec[i] = batch.num_tokens[i] = end
            self.requests[req_id].output_token_ids.extend(toks)
        if trace.is_recording():
            trace.record("sampled", sampled=dict(zip(batch.req_ids, sampled_token_ids)))
