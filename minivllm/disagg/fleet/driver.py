"""The fleet's driver: ``python -m minivllm.disagg.fleet`` and ``start_fleet``. P/D as the article
says it runs in practice, "N vLLM prefill instances and M vLLM decode instances, autoscaling them
based on the live request mix", as one Ray Serve application. It plays the part of Ray Serve's
``serve run`` (``ray/serve/scripts.py``, ``serve.run`` in ``ray/serve/api.py``) for Ray Serve
LLM's ``build_pd_openai_app``: start or join Ray, start Serve, deploy, wait until it answers.

    python -m minivllm.disagg.fleet --prefill 1:3 --decode 1:3 --kv-connector ZmqPullConnector \\
        --port 8004 [--router kv|round_robin|serve] [--pd-min-uncached-tokens N]
        [--address auto|HOST:PORT] [--secure] [--model M]

- ``prefill`` and ``decode`` deployments of engine replicas (replicas.py), placed on nodes that
  carry the role's resource (``ray start --resources='{"prefill": 1}'``) where there are any;
- the ingress (ingress.py), which picks the decode replica first by the KV it holds (the engines'
  KV events, kv_pool.py), prefills remotely only where that pays, and calls both roles through
  ``DeploymentHandle``s;
- one autoscaling policy for both roles (autoscale.py).

The KV path across nodes: ``ZmqPullConnector`` (decode pulls from the prefill node);
``RedisStoreConnector``: the store at ``--kv-store-url``, else one the fleet starts on this node
and stops (``--secure``: a random password that only the replicas get, from ``FleetState``);
``SharedStorageConnector``: a folder every node mounts.

``MIN:MAX`` per role; one number is a fixed count. Without ``--address`` the fleet starts a Ray of
its own (``ray.init(address="local")``, whatever other Ray runs here) and stops it at exit; with
it, the fleet joins the cluster and at exit deletes only what it started. Ctrl-C or SIGTERM stops
the fleet, its own KV store included; the store also dies with the command when the command is
killed outright (SIGKILL, the OOM killer).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from minivllm.disagg.fleet.app import (CONNECTORS, ROUTER_NAMES, FleetConfig, FleetConfigError,
                                       app_config, check_config, http_options, parse_range)
from minivllm.disagg.fleet.autoscale import FleetTargets
from minivllm.disagg.fleet.replicas import APP, MARKER, NAMESPACE, ROLES

INSTALL = 'the fleet runs on Ray Serve, which is not installed: pip install "minivllm[fleet]"'
# FleetTargets' fields that are flags of their own (the bounds come from --prefill and --decode).
POLICY_FLAGS = ("prefill_target_queued_tokens", "decode_target_running", "decode_target_kv_usage",
                "upscale_delay_s", "downscale_delay_s")


@dataclass
class Fleet:
    """A running fleet: ``url`` (the ingress); ``stop()`` stops what ``start_fleet`` started."""
    url: str
    config: FleetConfig                # the one that runs: the caller's, with what it left open
    targets: FleetTargets
    api_key: Optional[str] = None
    kv_store: dict = field(default_factory=dict)     # the fleet's own store: url, pid, password
    _started: list = field(default_factory=list)     # "ray", "serve", "app", in that order
    _state: Any = None
    _store: Any = None                               # redis_server.RedisServer
    _owned_dirs: list = field(default_factory=list)

    def view(self) -> dict:
        import ray
        return ray.get(self._state.view.remote())

    def records(self) -> dict:
        import ray
        return ray.get(self._state.records.remote())

    def stop(self) -> None:
        """The application (every replica drains), Serve, the store, the state, then Ray: each
        only if this fleet started it."""
        import ray
        from ray import serve
        if not ray.is_initialized():
            return
        try:
            if "app" in self._started:
                serve.delete(APP)
            if "serve" in self._started:
                serve.shutdown()
        finally:
            if self._store is not None:       # after the replicas: no one uses it any more
                self._store.stop()
            if self._state is not None:
                ray.kill(self._state)
            if "ray" in self._started:
                ray.shutdown()
            for d in self._owned_dirs:
                shutil.rmtree(d, ignore_errors=True)

    def _serve_http(self, host: Optional[str], port: Optional[int]) -> dict:
        """The ingress's HTTP options; notes whether Serve must be started. Serve has no public
        call that says whether it runs and on which port, hence its client
        (``_get_global_client``)."""
        from ray.serve.context import _get_global_client

        from minivllm.disagg.launch import free_port
        try:
            http = _get_global_client(raise_if_no_controller_running=True).http_config
            running = {"host": http.host, "port": http.port}
        except Exception:                                      # noqa: BLE001  no Serve yet
            running = None
            self._started.append("serve")
        options = http_options(host, port, running)
        return dict(options, port=options["port"] or free_port(options["host"]))

    def _start_store_and_state(self) -> None:
        """On this (the driver's) node, so that they outlive any other node leaving: the fleet's
        own Redis store when it needs one, and ``FleetState``, which holds the keys. The store
        dies with this process even when it is killed outright (``die_with_parent``), so it is
        started from the thread that runs the fleet."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from minivllm.disagg.fleet.replicas import FleetState
        from minivllm.disagg.launch import free_port
        from minivllm.distributed.kv_transfer.redis_store import redacted
        from minivllm.distributed.kv_transfer.redis_server import RedisServer, unguarded_warning
        c, password = self.config, None
        if c.kv_connector == "RedisStoreConnector" and not c.kv_store_url:
            host = ray.util.get_node_ip_address() if c.node_ip else "127.0.0.1"
            password = secrets.token_urlsafe(24) if c.secure else None
            self._store = RedisServer(port=free_port(host), host=host, password=password,
                                      die_with_parent=True).start()
            self.kv_store = {"url": self._store.url_without_password, "pid": self._store.pid,
                             "password": password is not None}
            c = dataclasses.replace(c, kv_store_url=self.kv_store["url"])
            if msg := unguarded_warning(host, password, "pass --secure (a random password only "
                                                        "the fleet's replicas get)"):
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
        self.config = c
        kv_view = {"connector": c.kv_connector, "url": redacted(c.kv_store_url) if c.kv_store_url
                   else None, "path": c.shared_storage_path, "started_by_fleet": bool(self._store),
                   "password": password is not None}
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        bounds = {r: [getattr(self.targets, f"{r}_min"), getattr(self.targets, f"{r}_max")]
                  for r in ROLES}
        self._state = ray.remote(FleetState).options(
            name=c.state_actor, namespace=NAMESPACE, num_cpus=0, scheduling_strategy=here).remote(
            bounds, kv_view, {"api_keys": list(c.api_keys), "kv_store_password": password})

    def _deploy(self, http: dict) -> None:
        """Start Serve if needed and deploy the fleet as a config: Serve takes an application-level
        ``autoscaling_policy`` only from a ``ServeDeploySchema``, and deploys one only through its
        REST API or its client's ``deploy_apps`` (no public Python call), hence the client."""
        from ray import serve
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeDeploySchema
        if "serve" in self._started:
            serve.start(http_options=http)
        self._started.append("app")
        _get_global_client().deploy_apps(
            ServeDeploySchema(applications=[app_config(self.config, self.targets)]))
        self.url = f"http://{http['host']}:{http['port']}"
        self.api_key = self.config.api_keys[0] if self.config.api_keys else None

    def _wait_until_serving(self, startup_timeout: float) -> None:
        import httpx
        from ray import serve
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            status = serve.status().applications.get(APP)
            if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"the fleet did not start: {status.message}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fleet did not answer /health within {startup_timeout} s")
            time.sleep(0.5)


def start_fleet(config: FleetConfig, targets: FleetTargets = FleetTargets(),
                port: Optional[int] = 0, host: Optional[str] = None,
                address: Optional[str] = None, startup_timeout: float = 300.0) -> Fleet:
    """Start Ray (a cluster of its own, or join ``address``), start Serve, deploy the fleet, wait
    until it answers. ``host``/``port``: the ingress's (None: 127.0.0.1, 8000; port 0: a free
    one), or those of a Serve already running (app.http_options). ``config`` is never
    changed: ``Fleet.config`` is the one that runs. Call it from a thread that lives as long as
    the fleet (the main thread): on Linux the fleet's own KV store dies when that thread ends."""
    import ray
    check_config(config)
    fleet = Fleet("", _with_fleet_defaults(config), targets)
    if fleet.config.shared_storage_path != config.shared_storage_path:
        fleet._owned_dirs.append(fleet.config.shared_storage_path)
    if fleet.config.shared_storage_path:
        # A node that cannot see this file refuses to start (replicas.kv_transfer_config).
        open(os.path.join(fleet.config.shared_storage_path, MARKER), "w").close()
    if _start_ray(address, targets, fleet.config):
        fleet._started.append("ray")
    try:
        http = fleet._serve_http(host, port)        # refused before anything else starts
        # Place by role only where the cluster's nodes carry the roles' resources.
        carried = set(ROLES) <= set(ray.cluster_resources())
        fleet.config = dataclasses.replace(fleet.config, by_role=fleet.config.by_role and carried)
        fleet._start_store_and_state()
        fleet._deploy(http)
        fleet._wait_until_serving(startup_timeout)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def _with_fleet_defaults(config: FleetConfig) -> FleetConfig:
    """A copy with what the caller left open filled in: the state actor's name, a folder for
    ``SharedStorageConnector``."""
    changes: dict = {"state_actor": config.state_actor or f"fleet-state-{uuid.uuid4().hex[:8]}"}
    if config.kv_connector == "SharedStorageConnector" and not config.shared_storage_path:
        changes["shared_storage_path"] = tempfile.mkdtemp(prefix="minivllm-fleet-kv-")
    return dataclasses.replace(config, **changes)


def _start_ray(address: Optional[str], targets: FleetTargets, config: FleetConfig) -> bool:
    """Join ``address``, or start a cluster of the fleet's own (``address="local"``: never the
    one ``/tmp/ray/ray_current_cluster`` names). Returns whether this call started Ray."""
    import ray
    if ray.is_initialized():
        return False
    if address is not None:          # joined, not started: stop() leaves the cluster running
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        return False
    # Logical CPUs for every role at its max (a replica's torch threads come from its num_cpus).
    need = (targets.prefill_max + targets.decode_max) * config.replica_num_cpus
    ray.init(address="local", namespace=NAMESPACE, log_to_driver=False,
             num_cpus=max(os.cpu_count() or 1, math.ceil(need)))
    return True


def _parser() -> argparse.ArgumentParser:
    from minivllm.entrypoints.openai.api_server import DEFAULT_MODEL
    ap = argparse.ArgumentParser(prog="python -m minivllm.disagg.fleet", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d, c, add = FleetTargets(), FleetConfig(DEFAULT_MODEL), ap.add_argument   # their defaults
    for role in ROLES:
        add(f"--{role}", default=f"{getattr(d, role + '_min')}:{getattr(d, role + '_max')}",
            help=f"{role} replicas, MIN:MAX or N")
    add("--kv-connector", default=c.kv_connector, choices=CONNECTORS)
    add("--port", type=int, default=None,
        help="the ingress's port (default 8000). Where Serve already runs on the cluster, its HTTP "
             "options stay as they started: the ingress is on that Serve's host and port, and a "
             "different --port or --host is an error naming them")
    add("--host", default=None, help="the address the ingress binds (default 127.0.0.1)")
    add("--address", default=None, help="join this Ray cluster (auto or HOST:PORT)")
    add("--model", default=DEFAULT_MODEL)
    add("--seed", type=int, default=c.seed)
    add("--replica-num-cpus", type=float, default=c.replica_num_cpus,
        help="Ray CPUs per engine replica; also its torch threads")
    add("--server-args", default="", help="extra flags for every engine replica")
    add("--api-key", nargs="+", default=None,
        help="clients must send it (default: $VLLM_API_KEY, $MINIVLLM_API_KEY)")
    add("--secure", action="store_true",
        help="the fleet's own KV store gets a random password only the replicas get")
    add("--kv-store-url", default=None,
        help="RedisStoreConnector: a store you run (default: the fleet starts one)")
    add("--shared-storage-path", default=None,
        help="SharedStorageConnector: a folder every node mounts")
    add("--router", default=c.router, choices=ROUTER_NAMES,
        help="kv: by the KV each replica holds; round_robin; serve: Serve's default")
    add("--pd-min-uncached-tokens", type=int, default=c.pd_min_uncached_tokens,
        help="decode computes the prompt itself when it holds all but this many tokens "
             "(0: always a remote prefill)")
    add("--overlap-score-weight", type=float, default=c.overlap_score_weight,
        help="--router kv: a prompt block still to prefill against a block of load")
    for name in POLICY_FLAGS:
        add("--" + name.replace("_", "-"), type=type(getattr(d, name)), default=getattr(d, name),
            help="the autoscaling policy's (autoscale.FleetTargets, default %(default)s)")
    add("--startup-timeout", type=float, default=300.0)
    return ap


def main(argv: Optional[list[str]] = None) -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        print(INSTALL, file=sys.stderr)
        sys.exit(2)
    from minivllm.entrypoints.openai.auth import api_keys_from
    ap = _parser()
    a = ap.parse_args(argv)
    try:
        targets = FleetTargets(*parse_range(a.prefill), *parse_range(a.decode),
                               **{name: getattr(a, name) for name in POLICY_FLAGS})
    except ValueError as e:
        ap.error(str(e))
    config = FleetConfig(model=a.model, kv_connector=a.kv_connector, seed=a.seed,
                         server_args=a.server_args.split(), replica_num_cpus=a.replica_num_cpus,
                         api_keys=api_keys_from(a.api_key), secure=a.secure, router=a.router,
                         pd_min_uncached_tokens=a.pd_min_uncached_tokens,
                         overlap_score_weight=a.overlap_score_weight,
                         kv_store_url=a.kv_store_url, shared_storage_path=a.shared_storage_path)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_sigterm)
    fleet = None
    try:
        fleet = start_fleet(config, targets, port=a.port, host=a.host, address=a.address,
                            startup_timeout=a.startup_timeout)
        signal.signal(signal.SIGTERM, on_sigterm)     # ray.init installed its own: ours again
        print(f"fleet: {fleet.url}   (GET {fleet.url}/fleet)")
        if "serve" not in fleet._started:
            print(f"fleet: Ray Serve was already running here: the ingress is on its HTTP proxy, "
                  f"{fleet.url}", flush=True)
        view = fleet.view()
        print("FLEET " + json.dumps(dict(view, decisions=view["decisions"][-1:])), flush=True)
        while True:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except FleetConfigError as e:               # nothing started: say what to change
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    finally:
        if fleet is not None:
            fleet.stop()
            print("stopped the fleet", flush=True)


if __name__ == "__main__":
    main()
