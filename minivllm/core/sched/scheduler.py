"""The scheduler, mirroring vllm/v1/core/sched/scheduler.py (Dec-2025 semantics).

There are no prefill and decode phases: each step tries to close the gap between a request's
``num_computed_tokens`` and ``num_tokens_with_spec`` under a token budget. Running requests go first
(preempting from the back of ``running`` when ``allocate_slots`` fails), then waiting ones.

Article steps that live here:
- spec decode step 4: drafts in ``request.spec_token_ids`` count as new tokens, so ``allocate_slots``
  reserves their KV slots;
- P/D "cache lookup", "state update" and "build metadata object": the KV connector's
  ``get_num_new_matched_tokens``, ``update_state_after_alloc`` and ``build_connector_meta``;
  an asynchronous load parks its request in ``WAITING_FOR_REMOTE_KVS`` (blocks allocated) until the
  worker reports it in ``finished_recving`` (``_update_waiting_for_remote_kv``, with the other
  KV-transfer bookkeeping in ``kv_transfer.py``).
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

from minivllm import trace
from minivllm.config import VllmConfig
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.kv_cache_utils import get_request_block_hasher
from minivllm.core.sched.kv_transfer import KVTransferMixin
from minivllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.core.sched.utils import check_stop, record_schedule
from minivllm.request import Request, RequestStatus
from minivllm.spec_decode.metrics import SpecDecodingStats
from minivllm.steps import BREAKS, at_step


class Scheduler(KVTransferMixin):
    def __init__(self, vllm_config: VllmConfig, num_gpu_blocks: int,
                 detokenize: Optional[Callable[[list[int]], str]] = None) -> None:
        self.vllm_config = vllm_config
        sched, cache = vllm_config.scheduler_config, vllm_config.cache_config
        self.max_num_running_reqs = sched.max_num_seqs
        self.max_num_scheduled_tokens = sched.max_num_batched_tokens
        self.long_prefill_token_threshold = sched.long_prefill_token_threshold
        self.enable_chunked_prefill = sched.enable_chunked_prefill
        self.max_model_len = vllm_config.model_config.max_model_len
        self.block_size = cache.block_size
        self.detokenize = detokenize

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Sent to the worker in the *next* SchedulerOutput, then replaced by a new set.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0

        spec = vllm_config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec else 0
        # Drafters that write KV for their own drafts (EAGLE, EAGLE-3, the draft model) need k
        # lookahead slots, as vLLM 0.32's num_lookahead_tokens (config/vllm.py) gives them; n-gram
        # and Medusa write no KV and reserve none.
        self.num_lookahead_tokens = self.num_spec_tokens if spec and spec.needs_lookahead_slots else 0
        self.spec_decoding_stats = SpecDecodingStats(self.num_spec_tokens) if spec else None

        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks=num_gpu_blocks, block_size=self.block_size,
            max_model_len=self.max_model_len, enable_caching=cache.enable_prefix_caching,
            use_eagle=bool(spec and spec.use_eagle()))
        self.block_hasher = get_request_block_hasher(self.block_size)

        # P/D article step "Instantiation": the connector's scheduler-side instance.
        self.connector = None
        # Async KV loads: req_id -> tokens computed once the load lands (cut by load errors), and
        # the ids the worker reported loaded, not yet seen by the waiting loop.
        self.waiting_for_remote_kvs: dict[str, int] = {}
        self.finished_recving_kv_req_ids: set[str] = set()
        # Finished requests whose blocks are still held: req_id -> what they wait for
        # ({"sending"}: the connector's worker reads them out; {"recving"}: a load writes into them).
        self.delayed_free: dict[str, set[str]] = {}
        if vllm_config.kv_transfer_config is not None and vllm_config.kv_transfer_config.kv_connector:
            from minivllm.distributed.kv_transfer import KVConnectorFactory, KVConnectorRole
            self.connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER)
            if BREAKS and at_step("pd.init.scheduler"): breakpoint()

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: list[str], finished_status: RequestStatus) -> None:
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_finished_requests(self) -> bool:
        """vLLM's ``has_finished_requests``: finished ids the worker has not been told yet, or
        finished requests whose blocks wait for the connector (``finished_sending`` or the end of
        an asynchronous load). The engine keeps stepping for them (``has_requests``)."""
        if self.finished_req_ids:
            return True
        return len(self.requests) > len(self.running) + len(self.waiting)

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        req_to_new_blocks: dict[str, Any] = {}
        num_scheduled_tokens: dict[str, int] = {}
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        token_budget = self.max_num_scheduled_tokens
        has_sync_kv_loads = False

        # A: running requests.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            # Article step 4: drafts are part of num_tokens_with_spec, so they count as new tokens.
            num_new_tokens = request.num_tokens_with_spec - request.num_computed_tokens
            if 0 < self.long_prefill_token_threshold < num_new_tokens:
                num_new_tokens = self.long_prefill_token_threshold
            num_new_tokens = min(num_new_tokens, token_budget,
                                 self.max_model_len - 1 - request.num_computed_tokens)
            if num_new_tokens <= 0:
                req_index += 1
                continue

            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_lookahead_tokens=self.num_lookahead_tokens)
                if new_blocks is not None:
                    break
                # Out of KV blocks: preempt the lowest-priority (last) running request.
                victim = self.running.pop()
                self._preempt_request(victim)
                preempted_reqs.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break

            if BREAKS and at_step("spec.4", request.spec_token_ids): breakpoint()
            scheduled_running_reqs.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1
            if request.spec_token_ids:
                # The budget or max_model_len may have cut some drafts: keep only the scheduled ones.
                num_scheduled_spec = num_new_tokens + request.num_computed_tokens - request.num_tokens
                if num_scheduled_spec > 0:
                    scheduled_spec_decode_tokens[request.request_id] = (
                        request.spec_token_ids[:num_scheduled_spec])
                # Fresh drafts arrive through update_draft_token_ids() after this step.
                request.spec_token_ids = []

        # B: waiting requests, only if nothing had to be preempted.
        skipped_waiting: deque[Request] = deque()
        if not preempted_reqs:
            while self.waiting and token_budget > 0 and len(self.running) < self.max_num_running_reqs:
                request = self.waiting[0]
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    if not self._update_waiting_for_remote_kv(request):
                        skipped_waiting.append(self.waiting.popleft())
                        continue
                    request.status = (RequestStatus.PREEMPTED if request.num_preemptions
                                      else RequestStatus.WAITING)
                num_external_computed_tokens, load_kv_async = 0, False
                new_computed_blocks = None
                if request.num_computed_tokens == 0:
                    # Local prefix cache first (article, P/D "cache lookup": after local prefix-cache checks).
                    new_computed_blocks, num_new_local_computed_tokens = (
                        self.kv_cache_manager.get_computed_blocks(request))
                    if self.connector is not None:
                        num_external_computed_tokens, load_kv_async = (
                            self.connector.get_num_new_matched_tokens(
                                request, num_new_local_computed_tokens))
                        if num_external_computed_tokens is None:   # "ask again later"
                            skipped_waiting.append(self.waiting.popleft())
                            continue
                        request.num_external_computed_tokens = num_external_computed_tokens
                        if BREAKS and at_step("pd.lookup"): breakpoint()
                    num_computed_tokens = num_new_local_computed_tokens + num_external_computed_tokens
                else:   # back from an async load: its KV is in place, its blocks are allocated
                    num_new_local_computed_tokens = 0
                    num_computed_tokens = request.num_computed_tokens

                if load_kv_async:   # load first, compute later: allocate for the loaded tokens only
                    num_new_tokens = 0
                else:
                    num_new_tokens = request.num_tokens - num_computed_tokens
                    if 0 < self.long_prefill_token_threshold < num_new_tokens:
                        num_new_tokens = self.long_prefill_token_threshold
                    if not self.enable_chunked_prefill and num_new_tokens > token_budget:
                        break
                    num_new_tokens = min(num_new_tokens, token_budget)

                # As vLLM 0.32 (scheduler.py): no lookahead only while an asynchronous load is
                # pending (nothing is computed yet, so nothing drafts); a sync load or a plain
                # prefill drafts right after this step and gets its k slots now.
                effective_lookahead_tokens = 0 if load_kv_async else self.num_lookahead_tokens
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens + num_external_computed_tokens,
                    num_new_local_computed_tokens, new_computed_blocks,
                    num_lookahead_tokens=effective_lookahead_tokens, delay_cache_blocks=load_kv_async)
                if new_blocks is None:
                    break   # stays at the head of `waiting`
                if self.connector is not None:
                    # All of the request's blocks, lookahead included, on every call (also the one
                    # after an async load), as vLLM 0.32 passes kv_cache_manager.get_blocks().
                    self.connector.update_state_after_alloc(
                        request, self.kv_cache_manager.get_blocks(request.request_id),
                        num_external_computed_tokens)
                    if BREAKS and at_step("pd.update_state"): breakpoint()
                if load_kv_async:
                    # The worker fetches in the background; other requests keep running.
                    skipped_waiting.append(self.waiting.popleft())
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    self.waiting_for_remote_kvs[request.request_id] = num_computed_tokens
                    trace.record("remote_kv_wait", req_id=request.request_id,
                                 num_local_computed_tokens=num_new_local_computed_tokens,
                                 num_external_computed_tokens=num_external_computed_tokens)
                    if BREAKS and at_step("pd.async_wait"): breakpoint()
                    continue

                self.waiting.popleft()
                self.running.append(request)
                if num_external_computed_tokens > 0:   # not async here: loaded in this step
                    has_sync_kv_loads = True
                if request.status == RequestStatus.PREEMPTED:
                    scheduled_resumed_reqs.append(request)
                else:
                    scheduled_new_reqs.append(request)
                req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(
                    request.request_id)
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_computed_tokens
                trace.record("prefix_hit", req_id=request.request_id,
                             num_local_computed_tokens=num_new_local_computed_tokens,
                             num_external_computed_tokens=num_external_computed_tokens)
        self.waiting.extendleft(reversed(skipped_waiting))

        # C: finish the output.
        num_common_prefix_blocks = [0]
        if self.running:
            num_common_prefix_blocks = self.kv_cache_manager.get_num_common_prefix_blocks(
                self.running[0].request_id, len(self.running))
        new_reqs_data = [NewRequestData.from_request(
            r, req_to_new_blocks[r.request_id].get_block_ids()) for r in scheduled_new_reqs]
        cached_reqs_data = self._make_cached_request_data(
            scheduled_running_reqs, scheduled_resumed_reqs, req_to_new_blocks)
        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=cached_reqs_data,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            num_common_prefix_blocks=list(num_common_prefix_blocks),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted_reqs},
            has_sync_kv_loads=has_sync_kv_loads,
        )
        if self.connector is not None:
            # P/D "build metadata object": prefill marks stores, decode marks loads.
            scheduler_output.kv_connector_metadata = self.connector.build_connector_meta(
                scheduler_output)
            if BREAKS and at_step("pd.build_meta", scheduler_output.kv_connector_metadata): breakpoint()
        self._update_after_schedule(scheduler_output)
        if trace.is_recording():
            record_schedule(self, scheduler_output, token_budget)
        return scheduler_output

    def _make_cached_request_data(self, running_reqs: list[Request], resumed_reqs: list[Request],
                                  req_to_new_blocks: dict[str, Any]) -> CachedRequestData:
        data = CachedRequestData()
        for req in running_reqs + resumed_reqs:
            data.req_ids.append(req.request_id)
            resumed = req in resumed_reqs
            if resumed:
                data.resumed_req_ids.add(req.request_id)
                data.resumed_req_token_ids[req.request_id] = list(req.all_token_ids)
            data.new_block_ids.append(req_to_new_blocks[req.request_id].get_block_ids())
            data.num_computed_tokens.append(req.num_computed_tokens)
            data.num_output_tokens.append(req.num_output_tokens)
        return data

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        # num_computed_tokens is optimistic: advanced *before* the model runs; rejected drafts are
        # subtracted again in update_from_output.
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        self.finished_req_ids = set()

    def _preempt_request(self, request: Request) -> None:
        trace.record("preempt", req_id=request.request_id,
                     num_computed_tokens_before=request.num_computed_tokens)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # ------------------------------------------------------------------ outputs
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: Any) -> list[tuple[Request, list[int]]]:
        """Append sampled tokens, undo rejected drafts, stop finished requests.

        Returns (request, new_token_ids) for every request that got tokens or finished this step."""
        outputs: list[tuple[Request, list[int]]] = []
        stopped: set[str] = set()
        sampled = model_runner_output.sampled_token_ids
        kv_out = model_runner_output.kv_connector_output
        failed = self._handle_invalid_blocks(kv_out.invalid_block_ids) if (
            kv_out is not None and kv_out.invalid_block_ids) else set()
        if failed and self._kv_load_failure_policy() == "fail":
            outputs += self._finish_failed_loads(failed)
        if kv_out is not None:
            self._update_from_kv_xfer_finished(kv_out)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or req_id in failed:
                continue
            generated = sampled[model_runner_output.req_id_to_index[req_id]]
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                num_accepted = len(generated) - 1
                num_rejected = len(drafts) - num_accepted
                if request.num_computed_tokens > 0:
                    # Article step 7: rejected tokens leave num_computed_tokens; their KV slots are
                    # simply overwritten later, no blocks are freed.
                    request.num_computed_tokens -= num_rejected
                if self.spec_decoding_stats is not None:
                    self.spec_decoding_stats.observe_draft(len(drafts), num_accepted)
            new_token_ids, is_stopped = self._update_request_with_output(request, generated)
            if is_stopped:
                self._free_request(request)
                stopped.add(req_id)
            if new_token_ids or is_stopped:
                outputs.append((request, new_token_ids))
        if stopped:
            self.running = [r for r in self.running if r.request_id not in stopped]
        return outputs

    def _update_request_with_output(self, request: Request,
                                    new_token_ids: list[int]) -> tuple[list[int], bool]:
        for i, token_id in enumerate(new_token_ids):
            request.append_output_token_ids(token_id)
            if check_stop(request, self.max_model_len, self.detokenize):
                # Tokens after a stop (e.g. accepted drafts past an EOS) are dropped.
                if BREAKS and at_step("spec.8"): breakpoint()
                return new_token_ids[:i + 1], True
        return new_token_ids, False

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Article step 3: store the proposer's drafts in request.spec_token_ids."""
        for req_id, drafts in draft_token_ids.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            request.spec_token_ids = list(drafts)
            if BREAKS and at_step("spec.3", drafts): breakpoint()

    def _free_request(self, request: Request) -> None:
        """vLLM's ``_free_request``: the connector sees the blocks of the computed tokens and may
        keep them (``delay_free``) until its worker reports ``finished_sending``; a request whose
        asynchronous load is still writing into its blocks keeps them until ``finished_recving``,
        whatever the connector says (vLLM's ``finish_requests``)."""
        assert request.is_finished()
        req_id = request.request_id
        delay_free = False
        loading = (req_id in self.waiting_for_remote_kvs
                   and req_id not in self.finished_recving_kv_req_ids)
        self.waiting_for_remote_kvs.pop(req_id, None)
        self.finished_recving_kv_req_ids.discard(req_id)
        if self.connector is not None:
            delay_free, request.output_kv_transfer_params = self.connector.request_finished(
                request, self._computed_block_ids(request))
        self.finished_req_ids.add(req_id)
        self._delay_or_free(request, sending=bool(delay_free), recving=loading)

    def make_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: Any,
                     eos_token_id: Optional[int], prompt: Optional[str] = None) -> Request:
        return Request(request_id, prompt_token_ids, sampling_params, eos_token_id,
                       block_hasher=self.block_hasher, prompt=prompt)
