"""The fleet's engine replicas and the named actor that keeps the fleet's records, as Ray Serve
LLM's ``PDPrefillServer`` and ``PDDecodeServer`` (Ray 2.60's
``ray/llm/_internal/serve/serving_patterns/prefill_decode/pd_server.py``, over ``LLMServer`` in
``core/server/llm_server.py``) are its replicas. The classes become a Serve deployment and a
named actor when the fleet starts.

- ``EngineReplica``: one ``AsyncLLM`` (built as ``minivllm serve`` builds it) with its role's
  ``KVTransferConfig``. The ingress calls ``generate`` through a ``DeploymentHandle``, which runs
  the OpenAI server's own app in process (asgi.py): no HTTP server and no port of its own; only
  the KV path and the KV events listen on the network. Serve reads its load
  (``record_autoscaling_stats``, for autoscale.py) and where its KV events are
  (``record_routing_stats``, for kv_router.py).
- ``FleetState``: the keys (never in Serve's application config: app.py), every policy tick
  and the decisions among them, the replicas' events, and the routes the ingress took.
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import time
from typing import Any, AsyncIterator, Optional

from minivllm.disagg.fleet.autoscale import ROLE_METRICS

APP, NAMESPACE, ROLES = "minivllm-fleet", "minivllm-fleet", ("prefill", "decode")
MARKER = ".minivllm-fleet-marker"     # SharedStorageConnector: the file every node must see
MAX_TICKS = 5000          # the per-tick series: about 40 min at Serve's 0.5 s control loop
MAX_LISTED = 1000         # decisions and replica events kept
MAX_ROUTES = 20_000       # the routes kept (bench fleet: 3 x 96 requests, 2 roles)


def readable(t: float) -> str:
    """An epoch time as a person reads it (UTC, to the millisecond)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


class FleetState:
    """The fleet's named actor, on the node that started the fleet. Every policy tick goes to the
    ``metrics`` series; only a tick whose counts or wishes differ from the last listed one becomes
    a decision, so ``/fleet`` lists the ones a person needs to read."""

    def __init__(self, bounds: dict, kv_store: Any = None, keys: Any = None) -> None:
        self.bounds, self.kv_store, self._keys = bounds, kv_store, dict(keys or {})
        self.members: dict = {r: set() for r in ROLES}    # serving, as the replicas say
        self.ticks: collections.deque = collections.deque(maxlen=MAX_TICKS)
        self.decisions: collections.deque = collections.deque(maxlen=MAX_LISTED)
        self.events: collections.deque = collections.deque(maxlen=MAX_LISTED)
        self.routes: collections.deque = collections.deque(maxlen=MAX_ROUTES)
        self._listed: Any = None                          # the last listed decision's key

    def keys(self) -> dict:
        """``{"api_keys": [...], "kv_store_password": str | None}``: an actor call, so only Ray's
        control plane carries them."""
        return self._keys

    def record_event(self, role: str, replica: str, event: str, **extra: Any) -> None:
        """``serving``, ``draining``, ``drained``, or ``lost`` (the router saw a replica go that
        had not said it drains: ignored for one that had)."""
        if event in ("draining", "lost"):
            if replica not in self.members[role]:
                return
            self.members[role].discard(replica)
        elif event == "serving":
            self.members[role].add(replica)
        t = time.time()
        self.events.append({"time": t, "at": readable(t), "role": role, "replica": replica,
                            "event": event, **extra})

    def record_routes(self, routes: list) -> None:
        self.routes.extend(routes)

    def record_decision(self, record: dict) -> None:
        """One policy tick (autoscale.FleetAutoscalingPolicy): ``time``, the counts ``prefill``
        and ``decode``, ``running``, ``metrics``, ``wishes``, ``reason``."""
        record = dict(record, at=readable(record["time"]))
        self.ticks.append(record)
        key = (record["prefill"], record["decode"], tuple(sorted(record.get("wishes", {}).items())))
        if key != self._listed:
            self._listed = key
            self.decisions.append({k: record[k] for k in ("time", "at", "prefill", "decode",
                                                          "reason")})

    def view(self, last: int = 20) -> dict:
        """``GET /fleet``: per role its replicas (as Serve counts them), bounds and its own latest
        metrics; the KV store; the last decisions and, beside them, the replicas' events."""
        metrics = self.ticks[-1]["metrics"] if self.ticks else {}
        running = serving_replicas()
        out: dict = {r: {"replicas": running.get(r, len(self.members[r])),
                         "min": self.bounds[r][0], "max": self.bounds[r][1],
                         "metrics": {k: v for k, v in metrics.get(r, {}).items()
                                     if k in ROLE_METRICS[r]}} for r in ROLES}
        return dict(out, kv_store=self.kv_store, decisions=list(self.decisions)[-last:],
                    events=list(self.events)[-last:])

    def records(self) -> dict:
        """Everything kept (the notebook's and the bench's figures read this, never recompute):
        ``decisions``, ``events``, ``metrics`` (per tick) and ``routes`` (per request: the
        candidates, the blocks each held, their scores, the pick, whether prefill was remote)."""
        return {"decisions": list(self.decisions), "events": list(self.events),
                "metrics": list(self.ticks), "routes": list(self.routes)}


def serving_replicas() -> dict:
    """{role: replicas RUNNING} as Serve counts them (a replica lost with its node is not); {}
    where Serve cannot say (no Ray here, or the fleet is stopping)."""
    try:
        import ray
        from ray import serve
        if not ray.is_initialized():       # never start a Ray just to ask (serve.status would)
            return {}
        app = serve.status().applications.get(APP)
        return {r: app.deployments[r].replica_states.get("RUNNING", 0)
                for r in ROLES if app is not None and r in app.deployments}
    except Exception:                                     # noqa: BLE001
        return {}


def engine_load(async_llm: Any, last: dict) -> dict:
    """One replica's load now: requests in flight, the prompt tokens not yet prefilled, the KV
    cache's usage, and the mean TTFT/ITL since the previous call (``last`` carries the serving
    histograms' sums and counts between calls)."""
    sched = async_llm.engine.engine_core.scheduler
    waiting, running = list(sched.waiting), list(sched.running)   # list(): one atomic copy
    out = {"waiting_prompt_tokens": float(prompt_tokens_not_prefilled(waiting + running)),
           "running_prefills": float(sum(r.num_computed_tokens < r.num_prompt_tokens
                                         for r in running)),
           "running_requests": float(async_llm.num_pending),
           "kv_cache_usage": float(sched.kv_cache_manager.usage)}
    stats = async_llm.stats
    for key, hist in (("ttft_recent_s", stats.ttft), ("itl_recent_s", stats.itl)):
        s, n = last.get(key, (0.0, 0))
        out[key] = (hist.sum - s) / (hist.count - n) if hist.count > n else 0.0
        last[key] = (hist.sum, hist.count)
    return out


def prompt_tokens_not_prefilled(requests: Any) -> int:
    """The prompt tokens of requests whose prefill has not *finished*: a request counts, less its
    prefix-cache hit, until its first output token exists. ``num_computed_tokens`` is no measure:
    the scheduler advances it when it *schedules* a chunk, so with the default token budget a
    whole burst reads 0 while its one long forward still runs for seconds."""
    return sum(r.num_prompt_tokens - max(0, r.num_cached_tokens)
               for r in requests if r.num_output_tokens == 0)


def kv_transfer_config(role: str, config: dict, host: str, password: Any = None) -> dict:
    """This replica's ``KVTransferConfig`` (as JSON) for the fleet's connector."""
    name = config["kv_connector"]
    extra = dict(config.get("kv_extra_config") or {})
    if name == "ZmqPullConnector" and role == "prefill":
        extra.update(side_channel_host=host, side_channel_port=0)   # D pulls from this node
    elif name == "RedisStoreConnector":
        extra["url"] = config["kv_store_url"]
        if password:
            extra["password"] = password
    elif name == "SharedStorageConnector":
        path = extra["shared_storage_path"] = config["shared_storage_path"]
        if not os.path.exists(os.path.join(path, MARKER)):
            raise RuntimeError(
                f"SharedStorageConnector: this node ({host}) does not see the fleet's folder "
                f"{path} (its marker file is missing). It needs a folder every node mounts; "
                "across machines use ZmqPullConnector or RedisStoreConnector.")
    return {"kv_connector": name, "kv_connector_extra_config": extra,
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"}


class EngineReplica:
    """One prefill or decode engine as a Ray Serve replica (article: "N vLLM prefill instances and
    M vLLM decode instances"). Its torch threads come from its ``num_cpus``, so replicas sharing
    a node do not oversubscribe it."""

    def __init__(self, role: str, config: dict) -> None:
        import ray
        import torch
        from ray import serve

        from minivllm.core.kv_events_block_pool import with_kv_events
        from minivllm.config import KVEventsConfig
        from minivllm.entrypoints.openai.api_server import (build_app, build_async_llm,
                                                            make_arg_parser)
        self.role, self.config, self._last = role, config, {}
        threads = max(1, int(config["replica_num_cpus"]))
        torch.set_num_threads(threads)
        host = ray.util.get_node_ip_address() if config["node_ip"] else "127.0.0.1"
        self.state = ray.get_actor(config["state_actor"], namespace=NAMESPACE)
        password = ray.get(self.state.keys.remote()).get("kv_store_password")
        kv = kv_transfer_config(role, config, host, password)
        self.async_llm = build_async_llm(make_arg_parser().parse_args(
            ["--model", config["model"], "--seed", str(config["seed"]), "--num-threads",
             str(threads), "--kv-transfer-config", json.dumps(kv), *config["server_args"]]))
        self.kv_events = None
        if config["router"] == "kv":     # vLLM's kv_events_config, on free ports of this node
            endpoint = f"tcp://{host}:0"
            self.kv_events = with_kv_events(self.async_llm.engine.engine_core, KVEventsConfig(
                enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=endpoint))
        self.async_llm.start()
        self.app = build_app(self.async_llm, config["model"])
        self.replica = serve.get_replica_context().replica_id.unique_id
        ray.get(self.state.record_event.remote(role, self.replica, "serving"))

    async def generate(self, path: str, body: Optional[dict], request_id: str,
                       routing: Optional[dict] = None, method: str = "POST") -> AsyncIterator[Any]:
        """One OpenAI request (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``):
        yields ``{"status", "headers", "replica"}``, then the body's bytes as the server sends
        them. ``routing`` is for the request router (kv_router.py)."""
        from minivllm.disagg.asgi import call_asgi
        async for item in call_asgi(self.app, path, body, {"x-request-id": request_id}, method):
            yield dict(item, replica=self.replica) if isinstance(item, dict) else item

    def ready(self) -> str:
        return self.replica

    def record_routing_stats(self) -> dict:
        """What the request routers read every ``ROUTING_STATS_PERIOD_S``: the block size the
        index hashes by and where this replica's KV events are."""
        stats = {"block_size": self.async_llm.engine.engine_core.scheduler.kv_cache_manager
                 .block_size}
        if self.kv_events is not None:
            stats.update(kv_events_endpoint=self.kv_events.endpoint,
                         kv_events_replay_endpoint=self.kv_events.replay_endpoint)
        return stats

    def record_autoscaling_stats(self) -> dict:
        """Serve's custom autoscaling metrics (ray/serve/_private/replica.py collects them)."""
        return engine_load(self.async_llm, self._last)

    def check_health(self) -> None:
        if not self.async_llm.is_running:
            raise RuntimeError(f"engine loop stopped: {self.async_llm.errored!r}")

    async def __del__(self) -> None:
        """The drain, called by Serve before it stops this replica (scale-down, delete), once it
        routes nothing more here: wait until every request in flight has finished and no KV block
        is held (a prefill replica's wait for a decode replica's pull, or their lease's end)."""
        t0 = time.monotonic()
        await _quietly(lambda: self.state.record_event.remote(self.role, self.replica, "draining"))
        manager = self.async_llm.engine.engine_core.scheduler.kv_cache_manager
        while time.monotonic() < t0 + self.config["drain_timeout_s"] and (
                self.async_llm.num_pending or manager.usage > 0):
            await asyncio.sleep(0.1)
        self.async_llm.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        await _quietly(lambda: self.state.record_event.remote(
            self.role, self.replica, "drained", drain_s=time.monotonic() - t0))


async def _quietly(call: Any) -> None:
    try:
        await call()
    except Exception:                                     # noqa: BLE001  the fleet is stopping
        pass
