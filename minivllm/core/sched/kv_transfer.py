"""The scheduler's KV-transfer bookkeeping, mirroring the parts of vllm/v1/core/sched/scheduler.py
that only a KV connector exercises: the asynchronous-load path of the waiting loop (parking a
request whose load is asynchronous in ``WAITING_FOR_REMOTE_KVS``, ``_start_async_load``; taking it
up again from ``kv_holding_waiting`` once the load landed, ``schedule_kv_holding`` and
``_update_waiting_for_remote_kv``), failed loads (``_handle_invalid_blocks``), the worker's
finished transfers (``_update_from_kv_xfer_finished``), and the delayed free of finished requests
whose blocks a transfer still uses (``_delay_or_free``). A mixin of ``Scheduler``, kept apart so that the
scheduling loops read in one sitting, the synchronous path straight through; what it uses of the
scheduler is declared in ``SchedulerState`` (utils.py). Beside it, read only when needed (the
article's examples never need them): kv_holding.py, the queue's scan once a request waits there;
failed_loads.py, once a worker reports a failed load.

Delayed free (vLLM's ``_free_request`` / ``_update_from_kv_xfer_finished``): a finished request
leaves ``running`` / ``waiting`` at once, but its blocks and its ``requests`` entry stay while
(a) the connector's ``request_finished`` returned ``delay_free=True``, until the worker reports
the request in ``finished_sending`` (P in the pull model: D reads P's blocks after P finished), or
(b) an asynchronous load still writes into them, until ``finished_recving`` (an abort while
``WAITING_FOR_REMOTE_KVS``; the scheduler does this for every connector).
Step records: ``"delay_free"`` (req_id, reasons, block_ids) when a finished request keeps its
blocks, ``"delayed_free_done"`` (req_id, reason, block_ids) when they are freed at last (and
``"kv_load_failed"``: failed_loads.py).
"""
from __future__ import annotations

from typing import Any

from minivllm import trace
from minivllm.core.sched.utils import ComputedTokens, ScheduledRequests, SchedulerState
from minivllm.request import Request, RequestStatus
from minivllm.utils import cdiv


class KVTransferMixin(SchedulerState):
    # ------------------------------------------------------------------ asynchronous loads
    def _start_async_load(self, request: Request, computed_tokens: ComputedTokens) -> bool:
        """Load first, compute later: the connector's ``load_kv_async``. Blocks for the local
        hits and the external tokens only, not cached until the load lands; then the request
        waits in ``WAITING_FOR_REMOTE_KVS`` while the worker fetches in the background and other
        requests keep running. Returns False (nothing changed) when the blocks do not fit."""
        (new_computed_blocks, num_new_local_computed_tokens, num_external_computed_tokens,
         num_computed_tokens, _) = computed_tokens
        # No lookahead while the load is pending, as vLLM 0.32 (scheduler.py): nothing is
        # computed yet, so nothing drafts. The request gets its k slots once it runs.
        new_blocks = self._allocate_and_update_state(
            request, num_new_tokens=0, num_new_local_computed_tokens=num_new_local_computed_tokens,
            new_computed_blocks=new_computed_blocks,
            num_external_computed_tokens=num_external_computed_tokens, num_lookahead_tokens=0,
            delay_cache_blocks=True)
        if new_blocks is None:
            return False
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs[request.request_id] = num_computed_tokens
        trace.record("remote_kv_wait", req_id=request.request_id,
                     num_local_computed_tokens=num_new_local_computed_tokens,
                     num_external_computed_tokens=num_external_computed_tokens)
        return True

    def schedule_kv_holding(self, scheduled: ScheduledRequests) -> bool:
        """vLLM 0.32's ``kv_holding_waiting`` queue, scanned before ``waiting``: the requests whose
        asynchronous load was started, scheduled once their load landed (kv_holding.py, read only
        when the queue is not empty). Returns False when one found no room: then no waiting
        request is scheduled this step either, as in vLLM."""
        if not self.kv_holding_waiting:
            return True
        from minivllm.core.sched.kv_holding import schedule_kv_holding
        return schedule_kv_holding(self, scheduled)

    # ------------------------------------------------------------------ failed loads, transfers
    def _handle_invalid_blocks(self, invalid_block_ids: set[int]) -> set[str]:
        """External KV that failed to load after it was counted as computed (vLLM's
        ``_handle_invalid_blocks``): each affected request is cut back to its first invalid block.
        In failed_loads.py, read only once a load has failed. Returns the affected ids."""
        from minivllm.core.sched.failed_loads import handle_invalid_blocks
        return handle_invalid_blocks(self, invalid_block_ids)

    def _kv_load_failure_policy(self) -> str:
        ktc = self.vllm_config.kv_transfer_config
        return ktc.kv_load_failure_policy if ktc is not None else "recompute"

    def _finish_failed_loads(self, req_ids: set[str]) -> list[tuple[Request, list[int]]]:
        """``kv_load_failure_policy="fail"``: the requests whose KV did not load finish with
        ``FINISHED_ERROR`` (failed_loads.py)."""
        from minivllm.core.sched.failed_loads import finish_failed_loads
        return finish_failed_loads(self, req_ids)

    def _computed_block_ids(self, request: Request) -> list[int]:
        """The blocks that hold the request's computed tokens (vLLM passes
        ``get_block_ids_for_computed_tokens`` to ``request_finished``): lookahead blocks that were
        never written are not offered to a reader."""
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[0]
        return block_ids[:cdiv(max(request.num_computed_tokens, 0), self.block_size)]

    def _delay_or_free(self, request: Request, sending: bool, recving: bool) -> None:
        reasons = ({"sending"} if sending else set()) | ({"recving"} if recving else set())
        if reasons:
            self.delayed_free[request.request_id] = reasons
            trace.record("delay_free", req_id=request.request_id, reasons=sorted(reasons),
                         block_ids=self.kv_cache_manager.get_block_ids(request.request_id)[0])
        else:
            self.kv_cache_manager.free(request)
            del self.requests[request.request_id]

    def _release_delayed(self, req_id: str, reason: str) -> bool:
        """One transfer holding a finished request's blocks completed; free them once none does.
        Returns whether ``req_id`` was a delayed finished request."""
        reasons = self.delayed_free.get(req_id)
        if reasons is None:
            return False
        reasons.discard(reason)
        if not reasons:
            del self.delayed_free[req_id]
            request = self.requests.pop(req_id)
            trace.record("delayed_free_done", req_id=req_id, reason=reason,
                         block_ids=self.kv_cache_manager.get_block_ids(req_id)[0])
            self.kv_cache_manager.free(request)
        return True

    def _update_from_kv_xfer_finished(self, kv_out: Any) -> None:
        """vLLM's ``_update_from_kv_xfer_finished``: loads wake their request up in the next
        ``schedule()``; a finished request's held blocks are freed once its last transfer is done
        (``finished_sending`` on the producer, ``finished_recving`` after an abort)."""
        self.connector.update_connector_output(kv_out)
        for req_id in (kv_out.finished_recving or ()):
            if self._release_delayed(req_id, "recving"):
                continue
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():
                self.finished_recving_kv_req_ids.add(req_id)
        for req_id in (kv_out.finished_sending or ()):
            self._release_delayed(req_id, "sending")

    def _update_waiting_for_remote_kv(self, request: Request) -> bool:
        """vLLM's ``_update_waiting_for_remote_kv``: once the load is reported, the request's loaded
        tokens count as computed (only those before a failed block) and its full blocks enter the
        prefix cache. Returns whether the request can be scheduled now."""
        req_id = request.request_id
        if req_id not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.remove(req_id)
        num_computed_tokens = min(self.waiting_for_remote_kvs.pop(req_id), request.num_tokens - 1)
        if num_computed_tokens == 0:   # the first block already failed: start over, lookup included
            self.kv_cache_manager.free(request)
        elif self.kv_cache_manager.enable_caching:
            self.kv_cache_manager.cache_blocks(request, num_computed_tokens)
        request.num_computed_tokens = num_computed_tokens
        request.num_external_computed_tokens = min(request.num_external_computed_tokens,
                                                   num_computed_tokens)
        trace.record("remote_kv_ready", req_id=req_id, num_computed_tokens=num_computed_tokens)
        return True
