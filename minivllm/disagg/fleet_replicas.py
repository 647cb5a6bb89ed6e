"""The fleet's Ray Serve parts: the engine replicas (prefill or decode) and a small named actor that
holds the fleet's membership, the policy's decisions and the routes taken (the ingress is
fleet_ingress.py, the request routers kv_router.py).

Nothing here imports ``ray`` at module level: ``fleet.py`` wraps these classes with
``ray.remote`` / ``serve.deployment`` once it knows Ray is there (fleet_app.py).

- ``EngineReplica``: one ``AsyncLLM`` engine (what ``minivllm serve`` runs, built by the same
  functions) with its role's ``KVTransferConfig``. The ingress calls it through a
  ``DeploymentHandle``: ``generate`` runs one OpenAI request through the server's own app, in
  process (no HTTP server, no port: only the KV path and the KV events listen on the network).
  ``record_autoscaling_stats()`` is the load Serve hands the policy (disagg/autoscale.py);
  ``record_routing_stats()`` what the request router reads (kv_router.py).
- ``FleetState``: who serves (by role), every policy decision with the metrics behind it, the
  routes the ingress took, and the fleet's keys (``keys()``), which never go into Serve's
  application config (fleet_config.py).
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import time
from typing import Any, AsyncIterator, Optional

NAMESPACE = "minivllm-fleet"
APP_NAME = "minivllm-fleet"       # fleet_config.APP, the application Serve runs
ROLES = ("prefill", "decode")
MARKER = ".minivllm-fleet-marker"


ROLE_METRICS = {"prefill": ("waiting_prompt_tokens", "running_prefills", "kv_cache_usage",
                             "ttft_recent_s"),
                 "decode": ("running_requests", "kv_cache_usage", "itl_recent_s")}
MAX_TICKS = 5000          # the per-tick series: about 40 min at Serve's 0.5 s control loop
MAX_LISTED = 1000         # decisions and replica events kept
MAX_ROUTES = 20_000       # the router's choices kept (bench fleet: 3 x 96 requests, 2 roles)


def readable(t: float) -> str:
    """An epoch time as a person reads it (UTC, to the millisecond)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


class FleetState:
    """The fleet's named actor. Replicas register once serving and leave when they start
    draining; one that died is reported by the ingress's router, which sees it leave. The policy hands it one record per Serve control-loop tick: every tick goes
    to the ``metrics`` series; only a tick whose counts or wishes differ from the last listed one
    becomes a decision, so ``/fleet``'s decisions are the ones a person needs to read."""

    def __init__(self, bounds: dict, kv_store: Any = None, keys: Any = None) -> None:
        self.bounds = bounds                              # {"prefill": [min, max], ...}
        self.kv_store = kv_store                          # fleet_store.describe: no password
        self._keys = dict(keys or {})                     # fleet_config.fleet_keys
        self.members: dict = {r: set() for r in ROLES}    # role -> replica ids serving
        self.ticks: collections.deque = collections.deque(maxlen=MAX_TICKS)
        self.decisions: collections.deque = collections.deque(maxlen=MAX_LISTED)
        self.events: collections.deque = collections.deque(maxlen=MAX_LISTED)
        self.routes: collections.deque = collections.deque(maxlen=MAX_ROUTES)
        self._listed: Any = None                          # the last listed decision's key

    def keys(self) -> dict:
        """``{"api_keys": [...], "backend_api_key": str | None}``, asked once by the ingress and
        each replica at start (an actor call: only Ray's control plane carries it)."""
        return self._keys

    def register(self, role: str, replica: str) -> None:
        self.members[role].add(replica)
        self.record_event({"time": time.time(), "event": "serving", "role": role,
                           "replica": replica})

    def deregister(self, role: str, replica: str, event: str = "draining") -> None:
        """``draining`` (the replica says so), or ``left`` (the router saw it go): a replica that
        left without draining was ``lost``."""
        if replica in self.members[role]:
            self.members[role].discard(replica)
            self.record_event({"time": time.time(), "role": role, "replica": replica,
                               "event": "lost" if event == "left" else event})

    def record_routes(self, routes: list) -> None:
        self.routes.extend(routes)

    def record_decision(self, record: dict) -> None:
        """One tick of the policy (autoscale.FleetAutoscalingPolicy): ``time``, the counts
        ``prefill``/``decode``, ``running``, ``metrics``, ``wishes``, ``reason``."""
        record = dict(record, at=readable(record["time"]))
        self.ticks.append(record)
        key = (record["prefill"], record["decode"], tuple(sorted(record.get("wishes", {}).items())))
        if key != self._listed:
            self._listed = key
            self.decisions.append({k: record[k] for k in
                                   ("time", "at", "prefill", "decode", "reason") if k in record})

    def record_event(self, record: dict) -> None:
        self.events.append(dict(record, at=readable(record["time"])))

    def view(self, last: int = 20) -> dict:
        """``GET /fleet``: per role the replicas serving, bounds and its own latest metrics; the
        last decisions (a count or a wish changed) and, beside them, the replicas' events."""
        latest = self.ticks[-1] if self.ticks else {}
        running = serving_replicas()
        out: dict = {}
        for r in ROLES:
            mine = latest.get("metrics", {}).get(r, {})
            out[r] = {"replicas": running.get(r, len(self.members[r])), "min": self.bounds[r][0],
                      "max": self.bounds[r][1],
                      "metrics": {k: mine[k] for k in ROLE_METRICS[r] if k in mine}}
        out["kv_store"] = self.kv_store
        out["decisions"] = list(self.decisions)[-last:]
        out["events"] = list(self.events)[-last:]
        return out

    def records(self) -> dict:
        """Everything recorded (the notebook's and the bench's figures read this, never
        recompute): ``decisions``, ``events``, ``metrics`` (the per-tick series) and ``routes``
        (per request and role: the candidates, the blocks each held, their scores, the pick)."""
        return {"decisions": list(self.decisions), "events": list(self.events),
                "metrics": list(self.ticks), "routes": list(self.routes)}


def serving_replicas() -> dict:
    """{role: replicas RUNNING} as Serve itself counts them (``serve.status()``); a replica lost
    with its node, or whose leaving no router saw, is not counted. {} where Serve cannot say."""
    try:
        import ray
        from ray import serve
        if not ray.is_initialized():       # never start a Ray just to ask (serve.status would)
            return {}
        app = serve.status().applications.get(APP_NAME)
        return {r: app.deployments[r].replica_states.get("RUNNING", 0)
                for r in ROLES if app is not None and r in app.deployments}
    except Exception:                                     # noqa: BLE001  no Serve (tests, stop)
        return {}


def engine_load(async_llm: Any, last: dict) -> dict:
    """One replica's load now, read from its engine: the requests in flight, the scheduler's
    queue and the KV cache, and the mean TTFT/ITL since the previous call (from the serving
    histograms' sums and counts). ``last`` carries those sums between calls."""
    sched = async_llm.engine.engine_core.scheduler
    waiting, running = list(sched.waiting), list(sched.running)   # list(): one atomic copy
    out = {"waiting_prompt_tokens": float(prompt_tokens_not_prefilled(waiting + running)),
           "running_prefills": float(sum(r.num_computed_tokens < r.num_prompt_tokens
                                         for r in running)),
           "running_requests": float(async_llm.num_pending),
           "kv_cache_usage": float(sched.kv_cache_manager.usage)}
    for key, hist in (("ttft_recent_s", async_llm.stats.ttft), ("itl_recent_s", async_llm.stats.itl)):
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
    """This replica's ``KVTransferConfig`` (as JSON) for the fleet's connector; ``password``:
    the fleet's own Redis store's (fleet_store.FleetStore.password)."""
    name = config["kv_connector"]
    kv = {"kv_connector": name, "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
          "kv_connector_extra_config": dict(config.get("kv_extra_config") or {})}
    extra = kv["kv_connector_extra_config"]
    if name == "ZmqPullConnector" and role == "prefill":
        extra.update(side_channel_host=host, side_channel_port=0)   # D pulls from this node
    elif name == "RedisStoreConnector":
        extra["url"] = config["kv_store_url"]
        if password:
            extra["password"] = password
    elif name == "SharedStorageConnector":
        path = config["shared_storage_path"]
        if not os.path.exists(os.path.join(path, MARKER)):
            raise RuntimeError(
                f"SharedStorageConnector: this node ({host}) does not see the fleet's folder "
                f"{path} (its marker file is missing). It needs a folder every node mounts; "
                "across machines use ZmqPullConnector or RedisStoreConnector.")
        extra["shared_storage_path"] = path
    return kv


class EngineReplica:
    """One prefill or decode engine as a Ray Serve replica (article: "N vLLM prefill instances and
    M vLLM decode instances"). Its torch threads come from its ``num_cpus``, so replicas sharing
    a node do not oversubscribe it."""

    def __init__(self, role: str, config: dict, *_handles: Any) -> None:
        import ray
        import torch
        from ray import serve

        from minivllm.entrypoints.openai.api_server import (build_app as server_app,
                                                            build_async_llm, make_arg_parser)
        self.role, self.config, self._last = role, config, {}
        threads = max(1, int(config["replica_num_cpus"]))
        torch.set_num_threads(threads)
        host = ray.util.get_node_ip_address() if config.get("node_ip") else "127.0.0.1"
        self.state = ray.get_actor(config["state_actor"], namespace=NAMESPACE)
        password = None
        if config.get("kv_store_actor"):     # asked of the actor: never in Serve's app config
            store = ray.get_actor(config["kv_store_actor"], namespace=NAMESPACE)
            password = ray.get(store.password.remote())
        kv = kv_transfer_config(role, config, host, password)
        args = make_arg_parser().parse_args(
            ["--model", config["model"], "--seed", str(config["seed"]), "--num-threads",
             str(threads), "--kv-transfer-config", json.dumps(kv), *config["server_args"]])
        self.async_llm = build_async_llm(args)
        self.kv_events = self._publish_kv_events(host) if config.get("router") == "kv" else None
        self.async_llm.start()
        # The OpenAI server's own app, called in process by ``generate``: the same checks, the
        # same responses, no port of its own.
        self.app = server_app(self.async_llm, config.get("served_model_name") or config["model"])
        self.replica = serve.get_replica_context().replica_id.unique_id
        ray.get(self.state.register.remote(role, self.replica))

    def _publish_kv_events(self, host: str) -> Any:
        """The engine's prefix-cache changes on ZMQ, with a replay socket, on free ports of this
        node (vLLM's ``kv_events_config``); the router finds them in ``record_routing_stats``."""
        from minivllm.core.kv_events_block_pool import with_kv_events
        from minivllm.distributed.kv_events import KVEventsConfig
        endpoint = f"tcp://{host}:0"
        return with_kv_events(self.async_llm.engine.engine_core, KVEventsConfig(
            enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=endpoint))

    async def generate(self, path: str, body: Optional[dict], request_id: str,
                       routing: Optional[dict] = None, method: str = "POST") -> AsyncIterator[Any]:
        """One OpenAI request (``path``: ``/v1/completions``, ``/v1/chat/completions``,
        ``/v1/models``): yields ``{"status", "headers", "replica"}`` first, then the body's bytes
        as the server sends them (a stream's events one by one). Called with
        ``handle.options(stream=True)``; ``routing`` is the request router's (kv_router.py)."""
        from minivllm.disagg.asgi import call_asgi
        async for item in call_asgi(self.app, path, body, {"x-request-id": request_id}, method):
            yield dict(item, replica=self.replica) if isinstance(item, dict) else item

    def ready(self) -> str:
        return self.replica

    def record_routing_stats(self) -> dict:
        """What the request routers read (kv_router.py), every ``request_routing_stats_period_s``:
        the block size the index hashes by and where this replica's KV events are."""
        manager = self.async_llm.engine.engine_core.scheduler.kv_cache_manager
        stats = {"block_size": manager.block_size}
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
        """Graceful drain, called by Serve before it stops this replica (scale-down, delete).
        Serve has already stopped routing to it; wait until every request in flight has finished
        and no KV block is held (a prefill replica's blocks wait for a decode replica's pull, or
        for their lease to end); then stop."""
        t0 = time.monotonic()
        try:
            await self.state.deregister.remote(self.role, self.replica)
        except Exception:                                 # noqa: BLE001  the fleet is stopping
            pass
        sched = self.async_llm.engine.engine_core.scheduler
        deadline = t0 + self.config["drain_timeout_s"]
        while time.monotonic() < deadline and (self.async_llm.num_pending
                                               or sched.kv_cache_manager.usage > 0):
            await asyncio.sleep(0.1)
        self.async_llm.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        try:
            await self.state.record_event.remote(
                {"time": time.time(), "event": "drained", "role": self.role,
                 "replica": self.replica, "drain_s": time.monotonic() - t0})
        except Exception:                                 # noqa: BLE001
            pass
