"""The fleet's Ray Serve parts: the engine replicas (prefill or decode), the ingress, and a small
named actor that holds the fleet's membership and the policy's decisions.

Nothing here imports ``ray`` at module level: ``fleet.py`` wraps these classes with
``ray.remote`` / ``serve.deployment`` once it knows Ray is there (``fleet_app``).

- ``EngineReplica``: one ``AsyncLLM`` engine (what ``minivllm serve`` runs, built by the same
  functions) with its role's ``KVTransferConfig``, its OpenAI server on the node's address, and
  ``record_autoscaling_stats()``, the load Serve hands the policy (disagg/autoscale.py).
- ``FleetProxy``: the P/D proxy (disagg/proxy.py) whose pools are the replicas registered now.
- ``FleetIngress``: the ingress deployment; it builds its app once it runs, with the keys.
- ``FleetState``: who serves (by role), every policy decision with the metrics behind it, and the
  fleet's keys (``keys()``), which never go into Serve's application config (fleet_config.py).
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import threading
import time
from typing import Any

from minivllm.disagg.proxy import DisaggProxy, build_app

NAMESPACE = "minivllm-fleet"
ROLES = ("prefill", "decode")
MARKER = ".minivllm-fleet-marker"


ROLE_METRICS = {"prefill": ("waiting_prompt_tokens", "running_prefills", "kv_cache_usage",
                             "ttft_recent_s"),
                 "decode": ("running_requests", "kv_cache_usage", "itl_recent_s")}
MAX_TICKS = 5000          # the per-tick series: about 40 min at Serve's 0.5 s control loop
MAX_LISTED = 1000         # decisions and replica events kept


def readable(t: float) -> str:
    """An epoch time as a person reads it (UTC, to the millisecond)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


class FleetState:
    """The fleet's named actor. Replicas register their URL once serving and leave when they
    start draining; a replica that died without leaving is dropped by ``prune`` (its actor no
    longer answers). The policy hands it one record per Serve control-loop tick: every tick goes
    to the ``metrics`` series; only a tick whose counts or wishes differ from the last listed one
    becomes a decision, so ``/fleet``'s decisions are the ones a person needs to read."""

    def __init__(self, bounds: dict, kv_store: Any = None, keys: Any = None) -> None:
        self.bounds = bounds                              # {"prefill": [min, max], ...}
        self.kv_store = kv_store                          # fleet_store.describe: no password
        self._keys = dict(keys or {})                     # fleet_config.fleet_keys
        self.members: dict = {r: {} for r in ROLES}       # role -> {replica: (url, actor)}
        self.ticks: collections.deque = collections.deque(maxlen=MAX_TICKS)
        self.decisions: collections.deque = collections.deque(maxlen=MAX_LISTED)
        self.events: collections.deque = collections.deque(maxlen=MAX_LISTED)
        self._listed: Any = None                          # the last listed decision's key

    def keys(self) -> dict:
        """``{"api_keys": [...], "backend_api_key": str | None}``, asked once by the ingress and
        each replica at start (an actor call: only Ray's control plane carries it)."""
        return self._keys

    def register(self, role: str, replica: str, url: str, actor: Any) -> None:
        self.members[role][replica] = (url, actor)
        self.record_event({"time": time.time(), "event": "serving", "role": role,
                           "replica": replica})

    def deregister(self, role: str, replica: str, event: str = "draining") -> None:
        if self.members[role].pop(replica, None) is not None:
            self.record_event({"time": time.time(), "event": event, "role": role,
                               "replica": replica})

    async def prune(self) -> None:
        for role in ROLES:
            for replica, (_, actor) in list(self.members[role].items()):
                try:
                    await asyncio.wait_for(actor.__ray_ready__.remote(), timeout=2.0)
                except Exception:                         # noqa: BLE001  dead or unreachable
                    self.deregister(role, replica, "lost")

    async def urls(self) -> dict:
        return {r: sorted(u for u, _ in m.values()) for r, m in self.members.items()}

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
        out: dict = {}
        for r in ROLES:
            mine = latest.get("metrics", {}).get(r, {})
            out[r] = {"replicas": len(self.members[r]), "min": self.bounds[r][0],
                      "max": self.bounds[r][1],
                      "metrics": {k: mine[k] for k in ROLE_METRICS[r] if k in mine}}
        out["kv_store"] = self.kv_store
        out["decisions"] = list(self.decisions)[-last:]
        out["events"] = list(self.events)[-last:]
        return out

    def records(self) -> dict:
        """Everything recorded (the notebook's and the bench's figures read this, never
        recompute): ``decisions``, ``events`` and ``metrics``, the per-tick series."""
        return {"decisions": list(self.decisions), "events": list(self.events),
                "metrics": list(self.ticks)}


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
        import uvicorn
        from ray import serve

        from minivllm.disagg.launch import free_port
        from minivllm.entrypoints.openai.api_server import (build_app as server_app,
                                                            build_async_llm, make_arg_parser)
        self.role, self.config, self._last = role, config, {}
        threads = max(1, int(config["replica_num_cpus"]))
        torch.set_num_threads(threads)
        host = ray.util.get_node_ip_address() if config.get("node_ip") else "127.0.0.1"
        self.state = ray.get_actor(config["state_actor"], namespace=NAMESPACE)
        backend_key = ray.get(self.state.keys.remote()).get("backend_api_key")
        password = None
        if config.get("kv_store_actor"):     # asked of the actor: never in Serve's app config
            store = ray.get_actor(config["kv_store_actor"], namespace=NAMESPACE)
            password = ray.get(store.password.remote())
        kv = kv_transfer_config(role, config, host, password)
        args = make_arg_parser().parse_args(
            ["--model", config["model"], "--seed", str(config["seed"]), "--num-threads",
             str(threads), "--kv-transfer-config", json.dumps(kv), *config["server_args"]])
        self.async_llm = build_async_llm(args).start()
        keys = (backend_key,) if backend_key else ()
        app = server_app(self.async_llm, config.get("served_model_name") or config["model"], keys)
        port = free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        threading.Thread(target=self.server.run, name="minivllm-http", daemon=True).start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        self.url = f"http://{host}:{port}"
        self.replica = serve.get_replica_context().replica_id.unique_id
        ray.get(self.state.register.remote(role, self.replica, self.url,
                                           ray.get_runtime_context().current_actor))

    def record_autoscaling_stats(self) -> dict:
        """Serve's custom autoscaling metrics (ray/serve/_private/replica.py collects them)."""
        return engine_load(self.async_llm, self._last)

    def check_health(self) -> None:
        if not self.async_llm.is_running:
            raise RuntimeError(f"engine loop stopped: {self.async_llm.errored!r}")

    async def __del__(self) -> None:
        """Graceful drain, called by Serve before it stops this replica (scale-down, delete).
        Leave the membership first, so the ingress sends nothing new; then wait until every
        request in flight has finished and no KV block is held (a prefill replica's blocks wait
        for a decode replica's pull, or for their lease to end); then stop."""
        t0 = time.monotonic()
        try:
            await self.state.deregister.remote(self.role, self.replica)
        except Exception:                                 # noqa: BLE001  the fleet is stopping
            pass
        await asyncio.sleep(self.config["refresh_s"] + 0.1)   # the ingress's view catches up
        sched = self.async_llm.engine.engine_core.scheduler
        deadline = t0 + self.config["drain_timeout_s"]
        while time.monotonic() < deadline and (self.async_llm.num_pending
                                               or sched.kv_cache_manager.usage > 0):
            await asyncio.sleep(0.1)
        self.server.should_exit = True
        self.async_llm.shutdown()
        try:
            await self.state.record_event.remote(
                {"time": time.time(), "event": "drained", "role": self.role,
                 "replica": self.replica, "drain_s": time.monotonic() - t0})
        except Exception:                                 # noqa: BLE001
            pass


class FleetProxy(DisaggProxy):
    """The proxy's two stages over the fleet's replicas: the pools are re-read from
    ``FleetState`` (at most every ``refresh_s``) before each request."""

    def __init__(self, state_actor: str, refresh_s: float, **kw: Any) -> None:
        super().__init__([], [], dynamic=True, **kw)
        self._state_name, self._refresh_s, self._read = state_actor, refresh_s, 0.0
        self._state: Any = None

    async def state(self) -> Any:
        if self._state is None:
            import ray
            self._state = ray.get_actor(self._state_name, namespace=NAMESPACE)
        return self._state

    async def refresh(self) -> None:
        if time.monotonic() - self._read < self._refresh_s:
            return
        urls = await (await self.state()).urls.remote()
        self.prefill.update(urls["prefill"])
        self.decode.update(urls["decode"])
        self._read = time.monotonic()


class FleetIngress:
    """The ingress deployment (``serve.ingress()`` with no app: Serve calls
    ``__serve_build_asgi_app__`` once the replica runs). The app is built then, after the keys have
    been asked of ``FleetState``; the engine replicas are bound to it so they belong to the app."""

    def __init__(self, config: dict, *_replicas: Any) -> None:
        self.config = config

    async def __serve_build_asgi_app__(self) -> Any:
        import ray
        state = ray.get_actor(self.config["state_actor"], namespace=NAMESPACE)
        keys = await state.keys.remote()
        return ingress_app(self.config, keys.get("api_keys") or (), keys.get("backend_api_key"))


def ingress_app(config: dict, api_keys: Any = (), backend_api_key: Any = None):
    """The ingress's FastAPI app (built on the ingress replica): the proxy's routes, the same
    validation, API key and ``X-Request-Id`` flow, plus ``GET /fleet`` and ``GET /fleet/records``.
    ``api_keys``: the clients'; ``backend_api_key``: the replicas' (both from ``FleetState``)."""
    proxy = FleetProxy(config["state_actor"], config["refresh_s"], backend_api_key=backend_api_key)
    app = build_app(proxy, tuple(api_keys), guarded=("/v1", "/proxy", "/fleet"))

    @app.get("/fleet")
    async def fleet():
        return await (await proxy.state()).view.remote()

    @app.get("/fleet/records")
    async def records():
        return await (await proxy.state()).records.remote()

    async def prune_forever() -> None:     # a replica killed without draining leaves the pools
        while True:
            await asyncio.sleep(1.0)
            try:
                await (await proxy.state()).prune.remote()
            except Exception:                             # noqa: BLE001  the fleet is stopping
                pass

    @app.on_event("startup")
    async def start_pruning():
        app.state.pruner = asyncio.get_running_loop().create_task(prune_forever())
    return _OneRequestId(app)


class _OneRequestId:
    """Serve's HTTP proxy already puts ``X-Request-Id`` on the request (the client's, else a new
    one, which the proxy's stages then carry) and on the answer; the proxy's copy of the header
    is dropped here so the client sees it once."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __getattr__(self, name: str) -> Any:      # FastAPI attributes Serve looks at
        return getattr(self.app, name)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        async def send_once(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = dict(message, headers=[(k, v) for k, v in message.get("headers", [])
                                                 if k.lower() != b"x-request-id"])
            await send(message)
        await self.app(scope, receive, send_once if scope["type"] == "http" else send)
