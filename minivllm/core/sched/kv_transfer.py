"""The scheduler's KV-transfer bookkeeping, mirroring the parts of vllm/v1/core/sched/scheduler.py
that only a KV connector exercises. A mixin of ``Scheduler``, kept apart so that the scheduling
loops read in one sitting, the synchronous path straight through; what it uses of the scheduler is
declared in ``SchedulerState`` (utils.py).

The article's connector loads synchronously, inside the step, and frees a finished request's
blocks at once: that is all its examples run here (``_computed_block_ids``, ``_delay_or_free``).
Each method below keeps vLLM's name on the scheduler; what only other connectors or faults
exercise sits beside it, in a file read only when needed:
kv_holding.py, the asynchronous-load path (``_start_async_load``, the ``kv_holding_waiting``
queue, ``WAITING_FOR_REMOTE_KVS``, vLLM's ``_update_waiting_for_remote_kv``); delayed_free.py,
the worker's finished transfers and the finished requests whose blocks a transfer still uses;
failed_loads.py, once a worker reports a failed load (``_handle_invalid_blocks``,
``kv_load_failure_policy``).
"""
from __future__ import annotations

from typing import Any

from minivllm.core.sched.utils import ComputedTokens, ScheduledRequests, SchedulerState
from minivllm.request import Request
from minivllm.utils import cdiv


class KVTransferMixin(SchedulerState):
    # ------------------------------------------------------------------ asynchronous loads
    def _start_async_load(self, request: Request, computed_tokens: ComputedTokens) -> bool:
        """Load first, compute later (the connector's ``load_kv_async``): the request waits in
        ``WAITING_FOR_REMOTE_KVS`` while the worker fetches its KV (kv_holding.py). Returns
        False (nothing changed) when its blocks do not fit."""
        from minivllm.core.sched.kv_holding import start_async_load
        return start_async_load(self, request, computed_tokens)

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
        """A finished request's blocks are freed at once, unless a transfer still uses them:
        the connector's worker reads them out (``sending``) or a load still writes into them
        (``recving``); then they wait for the worker's report (delayed_free.py)."""
        if sending or recving:
            from minivllm.core.sched.delayed_free import delay_free
            delay_free(self, request, sending, recving)
        else:
            self.kv_cache_manager.free(request)
            del self.requests[request.request_id]

    def _update_from_kv_xfer_finished(self, kv_out: Any) -> None:
        """vLLM's ``_update_from_kv_xfer_finished``: the connector sees the worker's output; a
        finished load or send (asynchronous connectors only) is taken up in delayed_free.py."""
        self.connector.update_connector_output(kv_out)
        if kv_out.finished_recving or kv_out.finished_sending:
            from minivllm.core.sched.delayed_free import update_from_kv_xfer_finished
            update_from_kv_xfer_finished(self, kv_out)
