"""The model runner, mirroring vllm/v1/worker/gpu_model_runner.py (plus its KV-connector mixin).

One ``execute_model(scheduler_output)`` call is one engine step on the worker:
``_update_states`` (persistent batch; drafts copied into ``token_ids_cpu``, spec step 5) →
``_prepare_inputs`` (input ids, positions, slot mapping, logits indices; ``_calc_spec_decode_metadata``,
spec step 6) → forward inside ``set_forward_context`` and the KV-connector context manager (P/D
"context manager") → sampling, or the rejection sampler when drafts were scheduled (spec step 7) →
bookkeeping → ``propose_draft_token_ids`` (spec step 2).

vLLM today (0.32): Model Runner V1 splits this step in two. ``execute_model`` runs the forward and
returns ``None``; ``sample_tokens`` samples, rejects and drafts (EAGLE and the draft model propose
*before* ``_bookkeeping_sync`` there, n-gram and Medusa after it). Model Runner V2
(v1/worker/gpu/, the GPU default) has none of the article's names except ``take_draft_token_ids``.

With ``async_scheduling`` (vLLM 0.32's AsyncScheduler) the scheduled drafts are -1 placeholders: the
runner keeps its last proposals per request (``_req_draft_token_ids``) and writes them over the
placeholders in ``_update_states``, as gpu_model_runner.py's ``_prepare_input_ids`` does
(worker/async_drafts.py).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from minivllm import trace
from minivllm.attention.layer import bind_kv_caches, kv_cache_bytes_per_token
from minivllm.attention.metadata import AttentionMetadata
from minivllm.config import VllmConfig
from minivllm.core.sched.output import SchedulerOutput
from minivllm.forward_context import set_forward_context
from minivllm.model_executor.model_loader import load_model
from minivllm.sample.metadata import SamplingMetadata
from minivllm.sample.rejection_sampler import RejectionSampler
from minivllm.sample.sampler import Sampler
from minivllm.spec_decode.metadata import SpecDecodeMetadata
from minivllm.spec_decode.utils import TargetStepOutputs
from minivllm.steps import BREAKS, at_step
from minivllm.worker.async_drafts import drop_placeholder_drafts, num_real_drafts, substitute_drafts
from minivllm.worker.input_batch import CachedRequestState, InputBatch


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request row: accepted drafts + one bonus/recovered token, or [] for a partial
    # prefill chunk.
    sampled_token_ids: list[list[int]]
    kv_connector_output: Any = None
    timings: dict[str, float] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, vllm_config: VllmConfig, device: torch.device, dtype: torch.dtype,
                 kv_connector: Any = None) -> None:
        self.vllm_config = vllm_config
        self.device, self.dtype = device, dtype
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.kv_connector = kv_connector
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len,
                                      -(-self.max_model_len // self.block_size), self.block_size)
        self.sampler = Sampler()
        self.model: Any = None
        self.kv_caches: list[torch.Tensor] = []
        self._draft_token_ids: Optional[dict[str, list[int]]] = None
        self._draft_probs: dict[str, torch.Tensor] = {}   # req_id -> [num_drafts, vocab]
        self.defer_finalize = False   # set in initialize_kv_cache
        # Async scheduling: the drafts never reach the scheduler; req_id -> last proposals.
        self.use_async_scheduling = vllm_config.scheduler_config.async_scheduling
        self._req_draft_token_ids: dict[str, list[int]] = {}

        # Spec decode, article "Setup / init device": create the drafter and the rejection sampler.
        self.speculative_config = vllm_config.speculative_config
        self.drafter: Any = None
        self.rejection_sampler: Optional[RejectionSampler] = None
        if self.speculative_config is not None:
            from minivllm.spec_decode import create_drafter
            self.drafter = create_drafter(vllm_config, device, dtype)
            self.rejection_sampler = RejectionSampler(backend="auto")
            if BREAKS and at_step("spec.setup"): breakpoint()
        # EAGLE-3 reads residual streams of the target (vLLM's use_aux_hidden_state_outputs); the
        # learned drafters read this step's target states from target_step_outputs.
        self.use_aux_hidden_state_outputs = (self.speculative_config is not None
                                             and self.speculative_config.method == "eagle3")
        self.target_step_outputs: Optional[TargetStepOutputs] = None

    # ------------------------------------------------------------------ set-up
    def load_model(self) -> None:
        self.model = load_model(self.vllm_config.model_path, self.dtype, self.device,
                                attention_backend=self.vllm_config.attention_backend)
        if self.drafter is not None:
            # Article "Setup / load model": load draft weights (a no-op for n-gram).
            self.drafter.load_model(self.model)
            # A self-draft's layers would share the target's layer names; the connector keys files
            # by layer name, so they get their own.
            target_names = set(self.model.attn_layers())
            for name, layer in self._drafter_attn_layers().items():
                if name in target_names:
                    layer.layer_name = f"drafter.{name}"
            if BREAKS and at_step("spec.load"): breakpoint()

    def _drafter_attn_layers(self) -> dict[str, Any]:
        model = getattr(self.drafter, "model", None)
        if not getattr(self.drafter, "initialize_kv_cache", None) or model is None:
            return {}   # n-gram and Medusa keep no KV of their own
        return model.attn_layers()

    def kv_cache_bytes_per_block(self) -> int:
        per_token = kv_cache_bytes_per_token(self.model.attn_layers().values(), self.dtype)
        extra = self.drafter.kv_cache_bytes_per_token() if hasattr(
            self.drafter, "kv_cache_bytes_per_token") else 0
        return (per_token + extra) * self.block_size

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer."""
        self.kv_caches = bind_kv_caches(self.model.attn_layers().values(), num_blocks,
                                        self.block_size, self.dtype, self.device)
        if hasattr(self.drafter, "initialize_kv_cache"):
            self.drafter.initialize_kv_cache(num_blocks, self.block_size)
        # vLLM 0.32 registers every attention layer, the drafter's too (EAGLE, EAGLE-3, draft
        # model), and finalizes the connector after the drafter (``defer_finalize``): under P/D the
        # drafter's KV moves with the target's, so D's first draft pass reads P's draft KV instead
        # of slots nobody wrote. Only drafter layers with the target's KV layout can share the
        # connector's files; others stay local (the drafter then recomputes, as before).
        self.defer_finalize = False
        if self.kv_connector is not None:
            layers = dict(self.model.attn_layers())
            ref = next(iter(layers.values())).kv_cache
            draft = {name: layer for name, layer in self._drafter_attn_layers().items()
                     if layer.kv_cache.shape[2:] == ref.shape[2:]
                     and layer.kv_cache.dtype == ref.dtype}
            if draft and len(draft) == len(self._drafter_attn_layers()):
                layers.update(draft)
                self.defer_finalize = True
                self.drafter.kv_connector = self.kv_connector
            self.kv_connector.register_kv_caches(
                {name: layer.kv_cache for name, layer in layers.items()})

    # ------------------------------------------------------------------ batch state
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._req_draft_token_ids.pop(req_id, None)
        # Unscheduled requests leave the persistent batch (they keep their CachedRequestState).
        batch.remove_requests({r for r in batch.req_ids if r not in so.num_scheduled_tokens})
        for new in so.scheduled_new_reqs:
            gen = None
            if new.sampling_params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(new.sampling_params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids, new.sampling_params, gen,
                list(new.block_ids[0]), new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_ids = cached.new_block_ids[i][0] if cached.new_block_ids[i] else []
            if req_id in cached.resumed_req_ids:
                # Resumed after preemption: the block list is replaced, tokens restored.
                state.block_ids = list(new_ids)
                all_ids = cached.resumed_req_token_ids[req_id]
                state.output_token_ids = list(all_ids[len(state.prompt_token_ids):])
                batch.remove_requests({req_id})
            else:
                state.block_ids.extend(new_ids)
                # Drop tokens the scheduler did not keep (its output was discarded after a failed
                # KV load, or came after a stop).
                del state.output_token_ids[cached.num_output_tokens[i]:]
                if req_id in batch.req_id_to_index:
                    row = batch.req_id_to_index[req_id]
                    batch.block_table.append_row(new_ids, row)
                    batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
                    batch.num_tokens_no_spec[row] = batch.num_tokens[row] = state.num_tokens
        for req_id in so.num_scheduled_tokens:
            if req_id not in batch.req_id_to_index:
                batch.add_request(self.requests[req_id])
        # Article step 5: copy the scheduled drafts into token_ids_cpu after the real tokens.
        for req_id in batch.req_ids:
            row = batch.req_id_to_index[req_id]
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            if self.use_async_scheduling and drafts:
                # The scheduler sent -1 placeholders: our own proposals go in their place.
                drafts = substitute_drafts(drafts, self._req_draft_token_ids.get(req_id, ()))
                trace.record("spec_substitute", req_id=req_id, drafts=list(drafts))
            start = batch.num_tokens_no_spec[row]
            batch.token_ids_cpu[row, start:start + len(drafts)] = drafts
            batch.num_tokens[row] = start + len(drafts)
            batch.spec_token_ids[req_id] = list(drafts)
            if BREAKS and at_step("spec.5", drafts): breakpoint()

    def _prepare_inputs(self, so: SchedulerOutput):
        batch = self.input_batch
        n = batch.num_reqs
        num_sched = np.array([so.num_scheduled_tokens[r] for r in batch.req_ids], dtype=np.int32)
        cu = np.cumsum(num_sched)
        req_indices = np.repeat(np.arange(n), num_sched)
        offsets = np.arange(cu[-1]) - np.repeat(cu - num_sched, num_sched)
        positions = batch.num_computed_tokens_cpu[req_indices] + offsets
        # A placeholder left at -1 (async scheduling, no draft for it) is computed as token 0: it
        # is rejected, so nothing reads its row.
        input_ids = np.maximum(batch.token_ids_cpu[req_indices, positions], 0)
        slot_mapping = batch.block_table.compute_slot_mapping(req_indices, positions)
        seq_lens = batch.num_computed_tokens_cpu[:n] + num_sched
        max_blocks = int(batch.block_table.num_blocks_per_row[:n].max())
        dev = self.device
        md = AttentionMetadata(
            num_actual_tokens=int(cu[-1]),
            query_start_loc=torch.from_numpy(np.concatenate([[0], cu]).astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(batch.block_table.block_table[:n, :max_blocks]).to(dev),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            max_query_len=int(num_sched.max()), max_seq_len=int(seq_lens.max()))
        if trace.is_recording():   # the lists are built only when someone records
            trace.record("slot_mapping", req_ids=list(batch.req_ids), positions=positions.tolist(),
                         slot_mapping=slot_mapping.tolist())
        num_draft = np.array([len(batch.spec_token_ids.get(r, [])) for r in batch.req_ids])
        spec_md = None
        if num_draft.any():
            spec_md = self._calc_spec_decode_metadata(num_draft, cu)
            logits_indices = spec_md.logits_indices
        else:
            logits_indices = torch.from_numpy(cu - 1).to(dev)
        input_ids_t = torch.from_numpy(input_ids.astype(np.int64)).to(dev)
        return (input_ids_t, torch.from_numpy(positions.astype(np.int64)).to(dev), md,
                logits_indices, spec_md, seq_lens)

    def _calc_spec_decode_metadata(self, num_draft_tokens: np.ndarray,
                                   cu_num_scheduled_tokens: np.ndarray) -> SpecDecodeMetadata:
        """Article step 6: which hidden-state rows get logits, and where each draft's target lives.

        Request i's sampled rows are the last ``num_draft_tokens[i] + 1`` of its scheduled range;
        the target distribution for draft j is the logit one position *before* the draft itself."""
        num_sampled = num_draft_tokens + 1
        cu_num_sampled = np.cumsum(num_sampled)
        first_sampled = cu_num_sampled - num_sampled
        logits_indices = np.concatenate([
            np.arange(end - s, end) for end, s in zip(cu_num_scheduled_tokens, num_sampled)])
        bonus_logits_indices = cu_num_sampled - 1
        cu_num_draft = np.cumsum(num_draft_tokens)
        target_logits_indices = np.concatenate(
            [np.arange(f, f + d) for f, d in zip(first_sampled, num_draft_tokens)]).astype(np.int64)
        # The drafts are the inputs one row after their target rows.
        draft_token_ids = self.input_batch.token_ids_cpu[
            np.repeat(np.arange(len(num_draft_tokens)), num_draft_tokens),
            np.concatenate([self.input_batch.num_tokens_no_spec[i] + np.arange(d)
                            for i, d in enumerate(num_draft_tokens)]).astype(np.int64)]
        if BREAKS and at_step("spec.6"): breakpoint()
        t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(self.device)  # noqa: E731
        return SpecDecodeMetadata(
            draft_token_ids=t(draft_token_ids), num_draft_tokens=num_draft_tokens.tolist(),
            cu_num_draft_tokens=t(cu_num_draft).to(torch.int32),
            cu_num_sampled_tokens=t(cu_num_sampled).to(torch.int32),
            target_logits_indices=t(target_logits_indices),
            bonus_logits_indices=t(bonus_logits_indices), logits_indices=t(logits_indices),
            max_spec_len=int(num_draft_tokens.max()))

    # ------------------------------------------------------------------ the step
    def _kv_connector_context(self, so: SchedulerOutput):
        if self.kv_connector is None:
            return nullcontext(None)
        from minivllm.distributed.kv_transfer import maybe_get_kv_connector_output
        return maybe_get_kv_connector_output(self.kv_connector, so,
                                             defer_finalize=self.defer_finalize)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        batch = self.input_batch
        if so.total_num_scheduled_tokens == 0:
            kv_out = None
            if self.kv_connector is not None:
                from minivllm.distributed.kv_transfer import kv_connector_no_forward
                kv_out = kv_connector_no_forward(self.kv_connector, so)
            return ModelRunnerOutput([], {}, [], kv_connector_output=kv_out)
        input_ids, positions, md, logits_indices, spec_md, seq_lens = self._prepare_inputs(so)
        with set_forward_context(md, self.model.attn_layers(), self.kv_connector):
            # P/D "context manager": enter -> start_load_kv, exit -> wait_for_save.
            with self._kv_connector_context(so) as kv_connector_output:
                hidden_states = self.model(input_ids, positions)
        aux_hidden_states = None
        if self.use_aux_hidden_state_outputs:
            hidden_states, aux_hidden_states = hidden_states
        logits = self.model.compute_logits(hidden_states[logits_indices])
        # The drafters below see spec_md with every scheduled draft; sampling verifies the real ones.
        sample_md, sample_logits = spec_md, logits
        if spec_md is not None and self.use_async_scheduling:
            sample_md, sample_logits = drop_placeholder_drafts(spec_md, logits, [
                num_real_drafts(batch.spec_token_ids.get(r, ())) for r in batch.req_ids])

        n = batch.num_reqs
        # A partial prefill chunk samples nothing; drop its generator so the discarded draw does
        # not shift a seeded request's random stream.
        partial = seq_lens < batch.num_tokens[:n]
        generators = {i: g for i, g in batch.generators.items() if not partial[i]}
        params = [batch.sampling_params[r] for r in batch.req_ids]
        sampling_metadata = SamplingMetadata.from_params(
            params, generators, self.device,
            num_output_tokens=[len(self.requests[r].output_token_ids) for r in batch.req_ids])
        if sample_md is None:
            sampled = self.sampler(sample_logits, sampling_metadata).tolist()
            sampled_token_ids = [[] if partial[i] else [t] for i, t in enumerate(sampled)]
            if BREAKS and at_step("spec.1", so.scheduled_new_reqs): breakpoint()
        else:
            # Article step 7: the rejection sampler instead of regular sampling.
            bonus = self.sampler(sample_logits[sample_md.bonus_logits_indices], sampling_metadata,
                                 num_draft_tokens=sample_md.num_draft_tokens)
            out = self.rejection_sampler(sample_md, self._scheduled_draft_probs(sample_md),
                                         sample_logits[sample_md.target_logits_indices],
                                         bonus.view(-1, 1).to(torch.int32), sampling_metadata)
            sampled_token_ids = RejectionSampler.parse_output(
                out, logits.shape[-1], discard_req_indices=partial.nonzero()[0].tolist())
            if trace.is_recording() and self.rejection_sampler.last_record is not None:
                for i, rec in enumerate(self.rejection_sampler.last_record):
                    if sample_md.num_draft_tokens[i]:
                        trace.record("spec_verify", req_id=batch.req_ids[i], positions=rec)

        # Bookkeeping: append the sampled tokens to the persistent batch.
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

        if self.drafter is not None:
            if getattr(self.drafter, "uses_target_hidden_states", False):
                self.target_step_outputs = TargetStepOutputs(
                    input_ids.cpu().numpy(), positions.cpu().numpy(),
                    md.slot_mapping.cpu().numpy(), md.query_start_loc.cpu().numpy(), seq_lens,
                    hidden_states, aux_hidden_states, logits_indices, spec_md, sampled_token_ids)
            self._draft_token_ids = self.propose_draft_token_ids(sampled_token_ids, so)
            if self.use_async_scheduling:
                # Kept here for the next step's placeholders; a row that sampled and got no
                # drafts has none (the synchronous scheduler would store [] for it too).
                for i, req_id in enumerate(batch.req_ids):
                    if sampled_token_ids[i]:
                        self._req_draft_token_ids[req_id] = list(
                            self._draft_token_ids.get(req_id, ()))
                self._draft_token_ids = None
            self.target_step_outputs = None
        if self.defer_finalize:
            # vLLM's finalize_kv_connector: wait_for_save after the drafter saved its layers too.
            from minivllm.distributed.kv_transfer import finalize_kv_connector
            finalize_kv_connector(self.kv_connector, so, kv_connector_output)
        return ModelRunnerOutput(list(batch.req_ids), dict(batch.req_id_to_index),
                                 sampled_token_ids, kv_connector_output=kv_connector_output)

    def propose_draft_token_ids(self, sampled_token_ids: list[list[int]],
                                so: SchedulerOutput) -> dict[str, list[int]]:
        """Article step 2: after the forward pass and sampling, propose up to k drafts per request.

        A request gets at most as many drafts as it can still use: the next step emits up to
        ``drafts + 1`` tokens, so drafts stop one short of ``max_tokens`` and of the model length."""
        batch, k = self.input_batch, self.speculative_config.num_speculative_tokens
        limits = {}
        for i, req_id in enumerate(batch.req_ids):
            if not sampled_token_ids[i]:
                continue   # partial prefill: nothing to draft from yet
            state = self.requests[req_id]
            max_tokens = state.sampling_params.max_tokens or self.max_model_len
            limits[req_id] = max(0, min(k, max_tokens - len(state.output_token_ids) - 1,
                                        self.max_model_len - 1 - int(batch.num_tokens_no_spec[i])))
        drafts = self.drafter.propose_for_batch(self, limits, so)
        # draft_sample_method="probabilistic": keep each request's q for the next step's verify.
        self._draft_probs = dict(getattr(self.drafter, "last_draft_probs", None) or {})
        trace.record("spec_propose", drafts={r: list(d) for r, d in drafts.items()})
        if BREAKS and at_step("spec.2", any(drafts.values())): breakpoint()
        return drafts

    def _scheduled_draft_probs(self, spec_md: SpecDecodeMetadata) -> Optional[torch.Tensor]:
        """``draft_probs`` ``[num_draft_tokens, vocab]`` for the drafts scheduled this step, in
        batch order: the distributions they were sampled from (vLLM caches them the same way), or
        ``None`` when the drafter drafts greedily. The scheduler may have cut drafts, so a request
        uses the first rows of its cached ``q``; a draft without one (none cached) gets a one-hot
        row, which is what ``p_draft = 1`` means."""
        if not self._draft_probs:
            return None
        batch, rows = self.input_batch, []
        vocab = next(iter(self._draft_probs.values())).shape[-1]
        for i, req_id in enumerate(batch.req_ids):
            d = spec_md.num_draft_tokens[i]
            if not d:
                continue
            q = self._draft_probs.get(req_id)
            if q is None or q.shape[0] < d:
                ids = torch.tensor(batch.spec_token_ids[req_id][:d], device=self.device)
                q = torch.nn.functional.one_hot(ids.clamp(min=0), vocab).float()
            rows.append(q[:d])
        return torch.cat(rows).to(self.device)

    def take_draft_token_ids(self) -> Optional[dict[str, list[int]]]:
        drafts, self._draft_token_ids = self._draft_token_ids, None
        return drafts
