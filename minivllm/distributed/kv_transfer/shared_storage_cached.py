"""``SharedStorageConnector.build_connector_meta`` for the requests the worker already knows
(vLLM's ``scheduled_cached_reqs``: running, or resumed after a preemption) while one of them still
has a transfer pending: a prefix prefilled in chunks is stored only once its last chunk is
computed, so its store collects each step's new blocks; a preempted request whose lookup found
stored KV again re-loads it into its new block list.

Loaded only then: in the article's examples every prompt is prefilled in one step and nothing is
preempted, so a request's store or load is emitted in the step that admits it.
"""
from __future__ import annotations

from typing import Any


def update_cached_requests(connector: Any, meta: Any, cached: Any,
                           num_computed: dict[str, int]) -> None:
    """Add the loads of resumed requests to ``meta``, extend the pending stores of running ones
    by their new blocks, and note each request's computed tokens in ``num_computed``."""
    for i, req_id in enumerate(cached.req_ids):
        new_ids = list(cached.new_block_ids[i][0]) if cached.new_block_ids[i] else []
        num_computed[req_id] = cached.num_computed_tokens[i]
        resumed = req_id in cached.resumed_req_ids
        load = connector._requests_need_load.pop(req_id, None)
        if load is not None:     # a preempted request re-loads into its new block list
            assert resumed, f"{req_id}: a load can only start a (re)scheduled request"
            token_ids, folder, start = load
            meta.add_request(req_id, token_ids=token_ids, folder=folder, block_ids=new_ids,
                             block_size=connector._block_size, is_store=False, start=start)
        if req_id in connector._pending_stores:
            ids, name, blocks = connector._pending_stores[req_id]
            connector._pending_stores[req_id] = (ids, name,
                                                 new_ids if resumed else blocks + new_ids)
