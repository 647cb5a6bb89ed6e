"""The model runner, mirroring vllm/v1/worker/gpu_model_runner.py (Model Runner V1, vLLM 0.32's
split of a step into ``execute_model`` and ``sample_tokens``) and its KV-connector mixin.

One engine step on the worker, in the article's order:

- ``execute_model(scheduler_output)``: ``_update_states`` (the persistent batch; drafts copied into
  ``token_ids_cpu``, spec step 5) → ``_prepare_inputs`` (input ids, positions, slot mapping, logits
  indices; ``_calc_spec_decode_metadata``, spec step 6) → the forward inside ``set_forward_context``
  and the KV connector's context manager (P/D "context manager") → the logits. Returns ``None``: the
  step goes on in ``sample_tokens`` (a step with nothing scheduled returns its output at once).
- ``sample_tokens()``: the batch's ``SamplingMetadata`` (``_prepare_sampling``), then sampling, or
  the rejection sampler when drafts were scheduled (spec step 7: ``_rejection_sample``) →
  ``_bookkeeping_sync`` → ``propose_draft_token_ids`` (spec step 2). When a request asks for
  logprobs, ``_logprobs_outputs`` gathers them from the step's rows (vLLM's
  ``LogprobsTensors.tolists`` and ``_get_prompt_logprobs_dict``).

The KV connector's half (``kv_connector_model_runner_mixin.py``) is mixed in only when the engine
has a connector (``worker.get_model_runner_cls``); without one, the methods below put nothing
around the forward, so a step runs no P/D code.

This class is the article's runner. vLLM 0.32's variants (the runner's half of async scheduling,
``defer_finalize``, probabilistic drafting, the 0.32 connector context) are mixins beside it in
``worker/vllm_today/``, chosen at construction (``worker.get_model_runner_cls``);
``python -m minivllm.tour spec --then-and-now`` prints each override beside the function it
replaces. In vLLM 0.32, EAGLE and the draft model propose before ``_bookkeeping_sync``, n-gram and
Medusa after it; Model Runner V2 (v1/worker/gpu/, the GPU default) has none of the article's names
except ``take_draft_token_ids``.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Optional

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
from minivllm.sample.sampler import Sampler
from minivllm.spec_decode.metadata import SpecDecodeMetadata
from minivllm.utils import cdiv
from minivllm.worker.input_batch import CachedRequestState, InputBatch
from minivllm.worker.outputs import ExecuteModelState, ModelRunnerOutput

if TYPE_CHECKING:   # loaded with spec decode only
    from minivllm.sample.rejection_sampler import RejectionSampler
    from minivllm.spec_decode.utils import TargetStepOutputs

__all__ = ["ExecuteModelState", "ModelRunner", "ModelRunnerOutput"]

# One emitted (or prompt) token's logprobs: the ids and logprobs of the token first, then the top
# k, and the token's rank (vLLM's ``LogprobsLists`` row).
LogprobsTriple = tuple[list[int], list[float], int]


def _int32(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.asarray(values, dtype=np.int32)).to(device)


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
                                      cdiv(self.max_model_len, self.block_size), self.block_size)
        self.sampler = Sampler(vllm_config.model_config.logprobs_mode)
        self.model: Any = None
        self.kv_caches: list[torch.Tensor] = []
        self.execute_model_state: Optional[ExecuteModelState] = None
        self._draft_token_ids: Optional[dict[str, list[int]]] = None
        # This step's logprob rows ``[S, vocab]`` and where each request's tokens start, when a
        # request asked for logprobs (``_logprobs_outputs`` gathers the numbers).
        self._logprobs_rows: Optional[tuple[torch.Tensor, list[int]]] = None
        # req_id -> its prompt logprobs so far (a list, gathered over the prefill chunks), or
        # "done" once given (vLLM's ``num_prompt_logprobs`` / ``in_progress_prompt_logprobs_cpu``).
        self._prompt_logprobs_progress: Optional[dict[str, Any]] = None

        # Spec decode, article "Setup / init device": create the drafter and the rejection sampler.
        self.speculative_config = vllm_config.speculative_config
        self.drafter: Any = None
        self.rejection_sampler: Optional[RejectionSampler] = None
        if self.speculative_config is not None:
            from minivllm.sample.rejection_sampler import RejectionSampler
            from minivllm.spec_decode import create_drafter
            self.drafter = create_drafter(vllm_config, device, dtype)
            self.rejection_sampler = RejectionSampler(backend="block" if (
                self.speculative_config.rejection_sample_method == "block") else "auto")
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
            for name, layer in self.drafter.attn_layers().items():
                if name in target_names:
                    layer.layer_name = f"drafter.{name}"

    def kv_cache_bytes_per_block(self) -> int:
        per_token = kv_cache_bytes_per_token(self.model.attn_layers().values(), self.dtype)
        if self.drafter is not None:
            per_token += self.drafter.kv_cache_bytes_per_token()
        return per_token * self.block_size

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer."""
        self.kv_caches = bind_kv_caches(self.model.attn_layers().values(), num_blocks,
                                        self.block_size, self.dtype, self.device)
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks, self.block_size)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(
                {name: layer.kv_cache for name, layer in self.kv_connector_layers().items()})

    # ------------------------------------------------------------------ batch state
    def _update_states(self, so: SchedulerOutput) -> None:
        """The persistent batch follows the scheduler: finished requests leave, new ones get a
        ``CachedRequestState``, running ones their new blocks; then article step 5."""
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        # Unscheduled requests leave the persistent batch (they keep their CachedRequestState).
        batch.remove_requests({r for r in batch.req_ids if r not in so.num_scheduled_tokens})
        for new in so.scheduled_new_reqs:
            gen = None
            if new.sampling_params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(new.sampling_params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, new.prompt_token_ids, new.sampling_params, gen,
                list(new.block_ids[0]), new.num_computed_tokens)
        self._update_cached_requests(so)
        for req_id in so.num_scheduled_tokens:
            if req_id not in batch.req_id_to_index:
                batch.add_request(self.requests[req_id])
        # Article step 5: copy the scheduled drafts into token_ids_cpu after the real tokens.
        for row, req_id in enumerate(batch.req_ids):
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            start = batch.num_tokens_no_spec[row]
            batch.token_ids_cpu[row, start:start + len(drafts)] = drafts
            batch.num_tokens[row] = start + len(drafts)
            batch.spec_token_ids[req_id] = list(drafts)

    def _update_cached_requests(self, so: SchedulerOutput) -> None:
        """Requests scheduled before: their new blocks and computed tokens; a resumed one (back
        after preemption) gets its block list replaced and its tokens restored."""
        batch, cached = self.input_batch, so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_ids = cached.new_block_ids[i][0] if cached.new_block_ids[i] else []
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids)
                all_ids = cached.resumed_req_token_ids[req_id]
                state.output_token_ids = list(all_ids[len(state.prompt_token_ids):])
                batch.remove_requests({req_id})
                continue
            state.block_ids.extend(new_ids)
            # Drop tokens the scheduler did not keep (its output was discarded after a failed KV
            # load, or came after a stop).
            del state.output_token_ids[cached.num_output_tokens[i]:]
            if req_id in batch.req_id_to_index:
                row = batch.req_id_to_index[req_id]
                batch.block_table.append_row(new_ids, row)
                batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
                batch.num_tokens_no_spec[row] = batch.num_tokens[row] = state.num_tokens

    def _prepare_inputs(self, so: SchedulerOutput):
        batch = self.input_batch
        n = batch.num_reqs
        num_sched = np.array([so.num_scheduled_tokens[r] for r in batch.req_ids], dtype=np.int32)
        cu = np.cumsum(num_sched)
        req_indices = np.repeat(np.arange(n), num_sched)
        offsets = np.arange(cu[-1]) - np.repeat(cu - num_sched, num_sched)
        positions = batch.num_computed_tokens_cpu[req_indices] + offsets
        input_ids = batch.token_ids_cpu[req_indices, positions]
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
        if trace.active and trace.is_recording():   # the lists are built only when someone records
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
        the target distribution for draft j is the logit one position *before* the draft itself.
        ``num_draft_tokens`` and ``cu_num_scheduled_tokens`` are ``[batch]``; every index tensor
        out is int32 (the table in spec_decode/metadata.py). A worked example, checked by
        tests/test_spec_decode_metadata.py: a prefill chunk of 5 tokens, then a request verifying
        3 drafts (its sampled token and the 3 drafts: 4 tokens), then one verifying 1 draft::

            num_draft_tokens:        [0, 3, 1]
            cu_num_scheduled_tokens: [5, 9, 11]
            num_sampled_tokens:      [1, 4, 2]           drafts + 1
            cu_num_sampled_tokens:   [1, 5, 7]
            logits_indices:          [4, 5, 6, 7, 8, 9, 10]   last num_sampled_tokens rows of each
            target_logits_indices:   [1, 2, 3, 5]        rows of the logits: one per draft
            bonus_logits_indices:    [0, 4, 6]           each request's last logits row
            cu_num_draft_tokens:     [0, 3, 4]
        """
        num_sampled_tokens = num_draft_tokens + 1
        cu_num_sampled_tokens = np.cumsum(num_sampled_tokens)
        cu_num_draft_tokens = np.cumsum(num_draft_tokens)
        # Hidden-state rows: the last num_sampled_tokens of each request's scheduled range.
        first_logits_row = cu_num_scheduled_tokens - num_sampled_tokens
        logits_indices = np.concatenate(
            [np.arange(first, end) for first, end in zip(first_logits_row, cu_num_scheduled_tokens)])
        # Rows of the logits: draft j's target is request i's (j)th sampled row, its bonus the last.
        first_sampled_row = cu_num_sampled_tokens - num_sampled_tokens
        target_logits_indices = np.concatenate(
            [np.arange(first, first + n) for first, n in zip(first_sampled_row, num_draft_tokens)])
        bonus_logits_indices = cu_num_sampled_tokens - 1
        # The drafts are the inputs one row after their target rows: in token_ids_cpu, right
        # after each request's real tokens (step 5 put them there).
        draft_rows = np.repeat(np.arange(len(num_draft_tokens)), num_draft_tokens)
        draft_cols = np.concatenate([self.input_batch.num_tokens_no_spec[i] + np.arange(n)
                                     for i, n in enumerate(num_draft_tokens)])
        draft_token_ids = self.input_batch.token_ids_cpu[draft_rows, draft_cols]
        return SpecDecodeMetadata(
            draft_token_ids=_int32(draft_token_ids, self.device),
            num_draft_tokens=num_draft_tokens.tolist(),
            cu_num_draft_tokens=_int32(cu_num_draft_tokens, self.device),
            cu_num_sampled_tokens=_int32(cu_num_sampled_tokens, self.device),
            target_logits_indices=_int32(target_logits_indices, self.device),
            bonus_logits_indices=_int32(bonus_logits_indices, self.device),
            logits_indices=_int32(logits_indices, self.device),
            max_spec_len=int(num_draft_tokens.max()))

    # ------------------------------------------------------------------ no KV connector
    # KVConnectorModelRunnerMixin (kv_connector_model_runner_mixin.py) overrides these when the
    # engine has a connector.
    def kv_connector_layers(self) -> dict[str, Any]:
        return {}

    def maybe_get_kv_connector_output(self, scheduler_output: SchedulerOutput):
        """The P/D context manager around the forward: without a connector, nothing (``None``)."""
        return nullcontext(None)

    def kv_connector_no_forward(self, scheduler_output: SchedulerOutput) -> None:
        return None

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """Article step 1 (and every later step's forward): the large model runs over the
        scheduled tokens, drafts included. -> ``None``; ``sample_tokens`` finishes the step."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], {}, [], kv_connector_output=self.kv_connector_no_forward(so))
        input_ids, positions, md, logits_indices, spec_md, seq_lens = self._prepare_inputs(so)
        with set_forward_context(md, self.model.attn_layers(), self.kv_connector):
            # P/D "context manager": enter -> start_load_kv, exit -> wait_for_save.
            with self.maybe_get_kv_connector_output(so) as kv_connector_output:
                hidden_states = self.model(input_ids, positions)
        aux_hidden_states = None
        if self.use_aux_hidden_state_outputs:
            hidden_states, aux_hidden_states = hidden_states
        logits = self.model.compute_logits(hidden_states[logits_indices])
        self.execute_model_state = ExecuteModelState(
            so, logits, spec_md, input_ids, positions, md, seq_lens, hidden_states,
            aux_hidden_states, logits_indices, kv_connector_output)
        return None

    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        """The rest of the step (vLLM 0.32's ``sample_tokens``): regular sampling, or article step
        7 when drafts were scheduled; the sampled tokens into the persistent batch; then article
        step 2, the next drafts."""
        state, self.execute_model_state = self.execute_model_state, None
        sampling_metadata, partial = self._prepare_sampling(state.seq_lens)
        if state.spec_decode_metadata is None:
            sampled_token_ids = self._sample(state.logits, sampling_metadata, partial)
        else:
            sampled_token_ids = self._rejection_sample(state.spec_decode_metadata, state.logits,
                                                       sampling_metadata, partial)
        self._bookkeeping_sync(sampled_token_ids)
        if self.drafter is not None:
            self._draft_token_ids = self.propose_draft_token_ids(sampled_token_ids, state)
        batch = self.input_batch
        return ModelRunnerOutput(list(batch.req_ids), dict(batch.req_id_to_index),
                                 sampled_token_ids, kv_connector_output=state.kv_connector_output,
                                 **self._logprobs_outputs(sampled_token_ids, state))

    # ------------------------------------------------------------------ sampling
    def _logprobs_outputs(self, sampled_token_ids: list[list[int]],
                          state: ExecuteModelState) -> dict[str, Any]:
        """``ModelRunnerOutput``'s ``logprobs`` and ``prompt_logprobs_dict`` when a request asked
        for either; nothing otherwise. The step's logprob rows (``_logprobs_rows``) are used once."""
        params = self.input_batch.sampling_params
        if (self._logprobs_rows is None and not self._prompt_logprobs_progress
                and all(params[r].prompt_logprobs is None for r in self.input_batch.req_ids)):
            return {}
        kept, self._logprobs_rows = self._logprobs_rows, None
        return {"logprobs": None if kept is None else self._take_logprobs(*kept, sampled_token_ids),
                "prompt_logprobs_dict": self._get_prompt_logprobs_dict(state)}

    def _take_logprobs(self, rows: torch.Tensor, starts: list[int],
                       sampled_token_ids: list[list[int]]) -> list[Optional[list[LogprobsTriple]]]:
        """vLLM's ``LogprobsTensors.tolists``: per request row ``None``, or per emitted token its
        ``(ids, logprobs, rank)``; request i's tokens read ``rows`` ``[S, vocab]`` from
        ``starts[i]`` on."""
        from minivllm.sample.ops.logprobs import gather_logprobs
        out: list[Optional[list[LogprobsTriple]]] = []
        for i, req_id in enumerate(self.input_batch.req_ids):
            k, toks = self.input_batch.sampling_params[req_id].logprobs, sampled_token_ids[i]
            if k is None or not toks:
                out.append(None)
                continue
            idx = torch.arange(starts[i], starts[i] + len(toks), device=rows.device)
            token_ids = torch.tensor(toks, dtype=torch.long, device=rows.device)
            out.append(gather_logprobs(rows[idx], k, token_ids).tolists())
        return out

    def _get_prompt_logprobs_dict(self, state: ExecuteModelState
                                  ) -> dict[str, list[LogprobsTriple]]:
        """vLLM's ``_get_prompt_logprobs_dict``: for requests with ``prompt_logprobs`` whose prompt
        was (partly) computed this step, the logprobs of prompt token p + 1 at each position p,
        the target's ``log_softmax`` gathered over the prefill chunks and given once the prompt
        is done."""
        from minivllm.sample.ops.logprobs import gather_logprobs
        if self._prompt_logprobs_progress is None:
            self._prompt_logprobs_progress = {}
        progress = self._prompt_logprobs_progress
        for req_id in [r for r in progress if r not in self.requests]:
            del progress[req_id]
        done: dict[str, list[LogprobsTriple]] = {}
        qsl = state.attn_metadata.query_start_loc.tolist()
        positions = state.positions
        for i, req_id in enumerate(self.input_batch.req_ids):
            req = self.requests[req_id]
            k, num_prompt = req.sampling_params.prompt_logprobs, len(req.prompt_token_ids)
            if k is None or progress.get(req_id) == "done":
                continue
            first = int(positions[qsl[i]])
            if first == 0:
                progress[req_id] = []
            if not isinstance(progress.get(req_id), list):
                continue   # the prompt's start came from a cache: nothing to compute it from
            rows = [qsl[i] + j for j in range(qsl[i + 1] - qsl[i]) if first + j + 1 < num_prompt]
            if rows:
                logits = self.model.compute_logits(state.hidden_states[rows])
                targets = torch.tensor([req.prompt_token_ids[first + r - qsl[i] + 1] for r in rows],
                                       device=logits.device)
                progress[req_id] += gather_logprobs(logits.log_softmax(-1, dtype=torch.float32),
                                                    k, targets).tolists()
            if first + qsl[i + 1] - qsl[i] >= num_prompt:
                done[req_id], progress[req_id] = progress[req_id], "done"
        return done

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
            self._logprobs_rows = self._spec_logprobs_rows(spec_md, logits, bonus.logprobs)
        if trace.active and self.rejection_sampler.last_record is not None:
            for i, rec in enumerate(self.rejection_sampler.last_record):
                if spec_md.num_draft_tokens[i]:
                    trace.record("spec_verify", req_id=self.input_batch.req_ids[i], positions=rec)
        return self.rejection_sampler.parse_output(
            out, logits.shape[-1], discard_req_indices=partial.nonzero()[0].tolist())

    def _spec_logprobs_rows(self, spec_md: SpecDecodeMetadata, logits: torch.Tensor,
                            bonus_rows: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The logprob rows of a verification step ``[S, vocab]``, in the engine's
        ``logprobs_mode``: the target's at each draft (the emitted token there is the accepted
        draft or the recovered one), then the bonus row; and where each request's tokens start
        (token j of request i is row ``cu_num_sampled[i - 1] + j``)."""
        from minivllm.sample.ops.logprobs import logprobs_source
        mode = self.sampler.logprobs_mode
        target = (self.rejection_sampler.last_target_logits if mode.startswith("processed")
                  else logits[spec_md.target_logits_indices])
        rows = torch.empty((logits.shape[0], logits.shape[-1]), dtype=torch.float32,
                           device=logits.device)
        rows[spec_md.target_logits_indices] = logprobs_source(target, mode)
        rows[spec_md.bonus_logits_indices] = bonus_rows
        return rows, [0, *spec_md.cu_num_sampled_tokens.tolist()][:-1]

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
        if trace.active:
            trace.record("sampled", sampled=dict(zip(batch.req_ids, sampled_token_ids)))

    def propose_draft_token_ids(self, sampled_token_ids: list[list[int]],
                                state: ExecuteModelState) -> dict[str, list[int]]:
        """Article step 2: after the forward pass and sampling, propose up to k drafts per request.
        The article's ``propose_draft_token_ids(k)``: here k is the configuration's
        ``num_speculative_tokens``, and the arguments are what the drafters read.

        A request gets at most as many drafts as it can still use: the next step emits up to
        ``drafts + 1`` tokens, so drafts stop one short of ``max_tokens`` and of the model length."""
        batch, k = self.input_batch, self.num_spec_tokens_to_schedule(state.scheduler_output)
        limits = {}
        for i, req_id in enumerate(batch.req_ids):
            if not sampled_token_ids[i]:
                continue   # partial prefill: nothing to draft from yet
            state_i = self.requests[req_id]
            max_tokens = state_i.sampling_params.max_tokens or self.max_model_len
            limits[req_id] = max(0, min(k, max_tokens - len(state_i.output_token_ids) - 1,
                                        self.max_model_len - 1 - int(batch.num_tokens_no_spec[i])))
        if self.drafter.uses_target_hidden_states:   # EAGLE, EAGLE-3, Medusa
            from minivllm.spec_decode.utils import TargetStepOutputs
            self.target_step_outputs = TargetStepOutputs.from_state(state, sampled_token_ids)
        drafts = self.drafter.propose_for_batch(self, limits, state.scheduler_output)
        self.target_step_outputs = None
        if trace.active:
            trace.record("spec_propose", drafts={r: list(d) for r, d in drafts.items()})
        return drafts

    def num_spec_tokens_to_schedule(self, scheduler_output: SchedulerOutput) -> int:
        """This step's k: the configuration's ``num_speculative_tokens`` (vLLM 0.32's dynamic k
        looks it up by batch size instead: worker/vllm_today/dynamic_k.py)."""
        return self.speculative_config.num_speculative_tokens

    def take_draft_token_ids(self) -> Optional[dict[str, list[int]]]:
        drafts, self._draft_token_ids = self._draft_token_ids, None
        return drafts
