"""One pool of engine replicas (prefill or decode) as the ingress's process sees it: what the
ingress picks from and the pool's request router (kv_router.py) keeps current. Ray Serve LLM's
nearest counterpart is the ``KVTokenTracker`` its ``KVAwareRouter`` scores through (Ray 2.60's
``ray/llm/_internal/serve/routing_policies/kv_aware/kv_token_tracker.py``).

``PoolView``: the pool's replicas (Serve's ``RunningReplica``, kept current by the router's
``update_replicas``) and a ``KVIndex`` (kv_index.py) fed by each replica's KV events (a
``KVEventSubscriber`` per replica, its endpoints read from the replica's routing stats). The load
term comes from the ingress, which counts what it has in flight on each replica (``choose``). A
replica that leaves is forgotten, and ``on_left`` tells the fleet's state
(``FleetState.record_event``: "lost" unless it was draining).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from minivllm.disagg.fleet.kv_index import (OVERLAP_SCORE_WEIGHT, Candidate, KVIndex, pick,
                                            prompt_block_hashes)
from minivllm.distributed.kv_events import KVEventSubscriber

ROUTING_KWARG = "routing"        # the call's keyword argument the routers read
DEFAULT_BLOCK_SIZE = 16          # the engines' default, until a replica reports its own

_POOLS: dict[str, "PoolView"] = {}
_POOLS_LOCK = threading.Lock()


def pool_view(name: str) -> "PoolView":
    """This process's view of the pool ``name`` (made on first use: the router, or the ingress
    asking before any request, whichever comes first)."""
    with _POOLS_LOCK:
        if name not in _POOLS:
            _POOLS[name] = PoolView(name)
        return _POOLS[name]


class PoolView:
    def __init__(self, name: str) -> None:
        self.name = name
        self.index = KVIndex()
        self.replicas: dict[str, Any] = {}     # replica id -> Serve's RunningReplica
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self.on_left: Optional[Callable[[str], None]] = None     # the ingress tells FleetState
        self._lock = threading.Lock()          # the router's loop and the ingress's both use it

    def update(self, replicas: list) -> None:
        """Serve's current replicas of this pool; those gone are forgotten."""
        with self._lock:
            now = {r.replica_id.unique_id: r for r in replicas}
            left = [uid for uid in self.replicas if uid not in now]
            for uid in left:
                self.index.forget(uid)
                sub = self.subscribers.pop(uid, None)
                if sub is not None:
                    sub.close()
            self.replicas = now
        for uid in left:
            if self.on_left is not None:
                self.on_left(uid)

    def _read_events(self) -> None:
        """Subscribe to replicas that now report their events' endpoints; apply what arrived."""
        for uid, replica in self.replicas.items():
            stats = replica.routing_stats or {}
            if uid not in self.subscribers and stats.get("kv_events_endpoint"):
                sub = KVEventSubscriber(stats["kv_events_endpoint"],
                                        stats.get("kv_events_replay_endpoint"))
                for _, batch in sub.catch_up():        # what it published before we joined
                    self.index.apply(uid, batch.events)
                self.subscribers[uid] = sub
        for uid, sub in self.subscribers.items():
            for _, batch in sub.poll(0.0):
                self.index.apply(uid, batch.events)

    def block_size(self) -> int:
        for r in self.replicas.values():
            if (r.routing_stats or {}).get("block_size"):
                return int(r.routing_stats["block_size"])
        return DEFAULT_BLOCK_SIZE

    def choose(self, token_ids: list, ongoing: Optional[dict] = None,
               blocks_in_flight: Optional[dict] = None,
               weight: float = OVERLAP_SCORE_WEIGHT) -> tuple[Any, dict]:
        """The replica for a prompt: ``(replica id or None, the route: each candidate's cached
        blocks and score, the prompt's blocks)``. ``ongoing``: requests in flight per replica;
        ``blocks_in_flight``: their prompt blocks, the score's load term; ``weight``: the
        score's weight on the blocks still to prefill.

        The load is the ingress's own count, as Dynamo's router tracks its active sequences
        itself, not the replica's report: a report is up to a period old, and in a multi-turn chat
        it still counts the turn that just finished on that replica, so it would push the
        conversation's next turn away from the one replica that holds its prefix."""
        with self._lock:
            self._read_events()
            block_size = self.block_size()
            hashes = prompt_block_hashes(token_ids, block_size)
            candidates = [Candidate(uid, self.index.prefix_blocks(uid, hashes),
                                    (blocks_in_flight or {}).get(uid, 0),
                                    (ongoing or {}).get(uid, 0))
                          for uid in sorted(self.replicas)]
        best = pick(candidates, len(hashes), weight)
        route = {"pool": self.name, "prompt_blocks": len(hashes), "block_size": block_size,
                 "weight": weight,
                 "candidates": [{"replica": c.replica, "cached_blocks": c.cached_blocks,
                                 "blocks_in_use": c.blocks_in_use, "score": c.score}
                                for c in candidates],
                 "pick": best.replica if best else None,
                 "cached_blocks": best.cached_blocks if best else 0}
        return (best.replica if best else None), route
