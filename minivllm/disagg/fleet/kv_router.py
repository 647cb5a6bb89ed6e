"""The fleet's request routers: Ray Serve ``RequestRouter`` subclasses (Ray 2.60's public
``ray.serve.request_router``), set per deployment with ``request_router_config``, beside Ray Serve
LLM's ``KVAwareRouter`` (``ray/llm/_internal/serve/routing_policies/kv_aware/kv_aware_router.py``).
They run in the caller's process, the ingress, beside its ``DeploymentHandle``s.

- ``KVRouter`` (``--router kv``, the default): the replica the ingress picked from the pool's KV
  index (``PoolView.choose``: kv_index.py's ``score`` and ``pick``), passed in the call's
  ``routing`` argument; where it did not pick (no index yet) or its pick has left, the least loaded
  candidate. The ingress picks, not the router, because the P/D decision needs the decode replica
  *before* the prefill runs (llm-d's ``disagg-profile-handler``); the router makes it so.
- ``RoundRobinRouter`` (``--router round_robin``): each candidate in turn.
- ``--router serve``: no router of ours, Serve's default (power of two choices on queue length).

Both keep their pool's ``PoolView`` (kv_pool.py) current with Serve's replicas (``PoolRouter``).
Serve pickles a router's module by value, so the state the ingress shares with the routers lives
in kv_pool.py. Ray's ``KVAwareRouter`` is not used: it scores through a ``KVTokenTracker`` that
only Ray Serve LLM's own ingress builds (``ray.llm._internal``), with NVIDIA Dynamo's wheel.
"""
from __future__ import annotations

from typing import Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from minivllm.disagg.fleet.kv_pool import ROUTING_KWARG, pool_view


def _routing(pending_request: Optional[PendingRequest]) -> dict:
    return (pending_request.kwargs.get(ROUTING_KWARG) if pending_request else None) or {}


class PoolRouter(RequestRouter):
    """A router that keeps its pool's ``PoolView`` current with Serve's replicas; its subclasses
    choose. ``pool``: the ``request_router_kwargs`` entry (default: the deployment's name)."""

    def initialize_state(self, pool: str = "") -> None:
        self.pool = pool_view(pool or self._deployment_id.name)

    def update_replicas(self, replicas: list) -> None:
        super().update_replicas(replicas)
        self.pool.update(replicas)


class KVRouter(PoolRouter):
    """The ingress's pick from the pool's KV index; else the least loaded candidate."""

    async def choose_replicas(self, candidate_replicas: list,
                              pending_request: Optional[PendingRequest] = None) -> list:
        wanted = _routing(pending_request).get("replica")
        chosen = [r for r in candidate_replicas if r.replica_id.unique_id == wanted]
        if chosen:
            return [chosen]
        # Least loaded: Serve's cached queue lengths (public through ``replica_queue_len_cache``).
        def load(r: RunningReplica) -> int:
            return self.replica_queue_len_cache.get(r.replica_id) or 0
        return [sorted(candidate_replicas, key=load)[:1]] if candidate_replicas else []


class RoundRobinRouter(PoolRouter):
    """Each candidate in turn (the URL proxy's policy, for comparison). A request the ingress
    marks ``"turn": False`` (a ``GET /v1/models``) asks the replica whose turn it is without taking
    the turn: a client that lists the models before each chat still has its chats alternate."""

    def initialize_state(self, pool: str = "") -> None:
        super().initialize_state(pool)
        self._turn = 0

    async def choose_replicas(self, candidate_replicas: list,
                              pending_request: Optional[PendingRequest] = None) -> list:
        if not candidate_replicas:
            return []
        ring = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        chosen = ring[self._turn % len(ring)]
        if _routing(pending_request).get("turn", True):
            self._turn += 1
        return [[chosen]]


ROUTERS = {"kv": "minivllm.disagg.fleet.kv_router.KVRouter",
           "round_robin": "minivllm.disagg.fleet.kv_router.RoundRobinRouter",
           "serve": None}       # Serve's default
