"""``python -m minivllm.disagg.fleet``: P/D as the article says it runs in practice, "N vLLM prefill
instances and M vLLM decode instances, autoscaling them based on the live request mix", as one
Ray Serve application.

    python -m minivllm.disagg.fleet --prefill 1:3 --decode 1:3 --kv-connector ZmqPullConnector \\
        --port 8004 [--router kv|round_robin|serve] [--pd-min-uncached-tokens N]
        [--address auto|HOST:PORT] [--secure] [--model M]

- Two deployments, ``prefill`` and ``decode`` (fleet_replicas.EngineReplica): each replica one
  ``AsyncLLM`` engine with its role's ``KVTransferConfig``, placed on a node that carries the
  role's custom resource (``ray start --resources='{"prefill": 1}'``) when the cluster has one.
- The ingress (fleet_ingress.py): the OpenAI endpoints, ``--api-key``, ``GET /fleet``; it
  tokenizes each prompt, picks the decode replica first by the KV it holds, prefills remotely
  only where that pays, and calls both roles through ``DeploymentHandle``s.
- The request routers (kv_router.py: ``--router``), fed by each engine's KV events
  (distributed/kv_events.py) into one index per pool (kv_index.py).
- The KV path across nodes: ``ZmqPullConnector`` (decode pulls from the prefill node);
  ``RedisStoreConnector``: the store at ``--kv-store-url``, else one the fleet starts and stops
  (fleet_store.py: redis-server on this node's address; ``--secure`` gives it a random password
  only the replicas get; no key is written into Serve's application config: the ingress and the
  replicas ask ``FleetState``, fleet_config.py); ``SharedStorageConnector``: a folder every node
  mounts. ``GET /fleet`` names the store.
- One application-level autoscaling policy sizes both roles together from the load each replica
  reports (disagg/autoscale.py). Ray Serve takes it only from an application *config*
  (``autoscaling_policy`` in ``ServeApplicationSchema``), so the fleet deploys itself as a config
  whose ``import_path`` is fleet_app.py's ``fleet_app`` (fleet_config.app_config).

``MIN:MAX`` per role; one number is a fixed count. Without ``--address`` a Ray instance is
started for the fleet alone (``ray.init(address="local")``, stopped at exit), whatever other Ray
runs on the machine; with it the fleet joins a running cluster and, at exit, deletes only its own
application (and Serve, when it started Serve). Where Serve already runs, the ingress is on that
Serve's HTTP host and port (Serve fixes them when it starts): a ``--port`` or ``--host`` that
differs is refused with the running ones named. Ctrl-C or SIGTERM stops the fleet, its own KV
store included, and every Ray process it started.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from minivllm.disagg.autoscale import FleetTargets
from minivllm.disagg.fleet_config import (APP, CONNECTORS, ROUTER_NAMES,  # noqa: F401
                                          FleetConfig, FleetConfigError, app_config,
                                          check_config, fleet_keys, http_options, parse_range)
from minivllm.disagg.fleet_app import ROUTING_STATS_PERIOD_S  # noqa: F401  re-exported
from minivllm.disagg.fleet_replicas import MARKER, NAMESPACE, ROLES
from minivllm.disagg.kv_index import OVERLAP_SCORE_WEIGHT

INSTALL = 'the fleet runs on Ray Serve, which is not installed: pip install "minivllm[fleet]"'

@dataclass
class Fleet:
    """A running fleet: ``url`` (the ingress), ``stop()`` stops what ``start_fleet`` started."""
    url: str
    config: FleetConfig
    targets: FleetTargets
    api_key: Optional[str] = None
    _started_ray: bool = False
    _started_serve: bool = False
    _deployed: bool = False            # only then does stop() delete the application
    _state: Any = None
    _store: Any = None
    kv_store: dict = field(default_factory=dict)     # the fleet's own store: url, pid, password
    _owned_dirs: list = field(default_factory=list)

    def view(self) -> dict:
        import ray
        return ray.get(self._state.view.remote())

    def records(self) -> dict:
        import ray
        return ray.get(self._state.records.remote())

    def stop(self) -> None:
        import shutil

        import ray
        from ray import serve
        if not ray.is_initialized():
            return
        from minivllm.disagg.fleet_store import stop_store
        try:
            if self._deployed:
                serve.delete(APP)             # every replica drains (EngineReplica.__del__)
            if self._started_serve:
                serve.shutdown()
        finally:
            try:
                if self._store is not None:   # after the replicas: no one uses it any more
                    stop_store(self._store)
                    self._store = None
                if self._state is not None:
                    ray.kill(self._state)
            finally:
                if self._started_ray:
                    ray.shutdown()
                for d in self._owned_dirs:
                    shutil.rmtree(d, ignore_errors=True)


def start_fleet(config: FleetConfig, targets: FleetTargets = FleetTargets(),
                port: Optional[int] = 0, host: Optional[str] = None,
                address: Optional[str] = None, startup_timeout: float = 300.0) -> Fleet:
    """Start Ray (a cluster of its own, or join ``address``), start Serve, deploy the fleet, wait
    until it answers. ``host``/``port``: the ingress's (None: 127.0.0.1, 8000; port 0: a free
    one); where Serve already runs, its own, and others are a ``FleetConfigError``
    (fleet_config.http_options). ``config`` is never changed: ``Fleet.config`` is the one run."""
    check_config(config)
    asked, config = config, _with_fleet_defaults(config)
    fleet = Fleet("", config, targets)
    if config.shared_storage_path != asked.shared_storage_path:
        fleet._owned_dirs.append(config.shared_storage_path)
    if config.shared_storage_path:
        # A node that cannot see this file refuses to start (fleet_replicas.kv_transfer_config).
        open(os.path.join(config.shared_storage_path, MARKER), "w").close()
    fleet._started_ray = _start_ray(address, targets, config)
    try:
        http, fleet._started_serve = _serve_http(host, port)      # refused before anything starts
        fleet.config = config = _place_and_name(config)
        fleet.config = config = _start_fleet_actors(fleet, config, targets)
        _deploy(fleet, http, targets)
        _wait_until_serving(fleet, startup_timeout)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def _with_fleet_defaults(config: FleetConfig) -> FleetConfig:
    """A copy with what the caller left open filled in: a folder for ``SharedStorageConnector``,
    the state actor's name."""
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
    # Enough logical CPUs for every role at its max (Ray's CPUs are only bookkeeping; each
    # replica's torch threads still come from its own num_cpus).
    need = (targets.prefill_max + targets.decode_max) * config.replica_num_cpus
    ray.init(address="local", namespace=NAMESPACE, log_to_driver=False,
             num_cpus=max(os.cpu_count() or 1, math.ceil(need)))
    return True


def _serve_http(host: Optional[str], port: Optional[int]) -> tuple[dict, bool]:
    """The ingress's HTTP options and whether Serve must be started. Serve has no public call
    that says whether it runs and on which port, hence its client (``_get_global_client``)."""
    from ray.serve.context import _get_global_client

    from minivllm.disagg.launch import free_port
    try:
        http = _get_global_client(raise_if_no_controller_running=True).http_config
        running = {"host": http.host, "port": http.port}
    except Exception:                                      # noqa: BLE001  no Serve yet
        running = None
    options = http_options(host, port, running)
    options["port"] = options["port"] or free_port(options["host"])
    return options, running is None


def _place_and_name(config: FleetConfig) -> FleetConfig:
    """Place replicas by role only where the cluster's nodes carry the roles' resources."""
    import ray
    resources = ray.cluster_resources()
    return dataclasses.replace(config, by_role=config.by_role and all(r in resources
                                                                      for r in ROLES))


def _start_fleet_actors(fleet: Fleet, config: FleetConfig, targets: FleetTargets) -> FleetConfig:
    """On this (the driver's) node, so they outlive any other node leaving: the fleet's own KV
    store when it needs one, and ``FleetState`` (membership, decisions, the keys, which never go
    into the application's config: fleet_config)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from minivllm.disagg import fleet_store
    from minivllm.disagg.fleet_replicas import FleetState
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    if fleet_store.needs_own_store(config.kv_connector, config.kv_store_url):
        fleet._store, fleet.kv_store = fleet_store.start_store(
            config.secure, config.node_ip, here, NAMESPACE)
        config = dataclasses.replace(config, kv_store_url=fleet.kv_store["url"],
                                     kv_store_actor=fleet.kv_store["name"])
    kv_view = fleet_store.describe(config.kv_connector, config.kv_store_url,
                                   fleet._store is not None, bool(fleet.kv_store.get("password")),
                                   config.shared_storage_path)
    bounds = {r: [getattr(targets, f"{r}_min"), getattr(targets, f"{r}_max")] for r in ROLES}
    fleet._state = ray.remote(FleetState).options(
        name=config.state_actor, namespace=NAMESPACE, num_cpus=0,
        scheduling_strategy=here).remote(bounds, kv_view, fleet_keys(config))
    return config


def _deploy(fleet: Fleet, http: dict, targets: FleetTargets) -> None:
    """Start Serve if needed and deploy the fleet as a config: Serve takes an application-level
    ``autoscaling_policy`` only from a ``ServeDeploySchema``, and deploys one only through its
    REST API or its client's ``deploy_apps`` (no public Python call), hence the client."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema
    if fleet._started_serve:
        serve.start(http_options=http)
    fleet._deployed = True
    _get_global_client().deploy_apps(
        ServeDeploySchema(applications=[app_config(fleet.config, targets)]))
    fleet.url = f"http://{http['host']}:{http['port']}"
    fleet.api_key = fleet.config.api_keys[0] if fleet.config.api_keys else None


def _wait_until_serving(fleet: Fleet, startup_timeout: float) -> None:
    import httpx
    from ray import serve
    deadline = time.monotonic() + startup_timeout
    while True:
        try:
            if httpx.get(fleet.url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        status = serve.status().applications.get(APP)
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"the fleet did not start: {status.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the fleet did not answer /health within {startup_timeout} s")
        time.sleep(0.5)


def _parser() -> argparse.ArgumentParser:
    from minivllm.entrypoints.openai.api_server import DEFAULT_MODEL
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = FleetTargets()
    ap.add_argument("--prefill", default="1:3", help="prefill replicas, MIN:MAX or N")
    ap.add_argument("--decode", default="1:3", help="decode replicas, MIN:MAX or N")
    ap.add_argument("--kv-connector", default="ZmqPullConnector", choices=CONNECTORS)
    ap.add_argument("--port", type=int, default=None,
                    help="the ingress's port: Serve's HTTP proxy's (default 8000). Where Serve "
                         "already runs on the cluster (--address), its HTTP options stay as they "
                         "started: the ingress is on that Serve's host and port, and a different "
                         "--port or --host is an error naming them")
    ap.add_argument("--host", default=None, help="the address the ingress binds (default "
                                                 "127.0.0.1; see --port)")
    ap.add_argument("--address", default=None,
                    help="join this Ray cluster (auto or HOST:PORT); default: a local Ray")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replica-num-cpus", type=float, default=1.0,
                    help="Ray CPUs per engine replica; also its torch threads")
    ap.add_argument("--server-args", default="", help="extra flags for every engine replica")
    ap.add_argument("--api-key", nargs="+", default=None,
                    help="clients must send it (default: $VLLM_API_KEY, $MINIVLLM_API_KEY)")
    ap.add_argument("--secure", action="store_true",
                    help="the fleet's own KV store gets a random password only the replicas get")
    ap.add_argument("--kv-store-url", default=None,
                    help="RedisStoreConnector: a store you run (redis://[:PASSWORD@]HOST:PORT/0); "
                         "default: the fleet starts one on this node and stops it at exit")
    ap.add_argument("--shared-storage-path", default=None,
                    help="SharedStorageConnector: a folder every node mounts")
    ap.add_argument("--router", default="kv", choices=ROUTER_NAMES,
                    help="kv: by the KV each replica holds (its prefix-cache events); "
                         "round_robin; serve: Serve's default (power of two choices)")
    ap.add_argument("--pd-min-uncached-tokens", type=int, default=64,
                    help="decode is picked first; when it holds all but at most this many prompt "
                         "tokens it computes them itself, no remote prefill (0: always remote)")
    ap.add_argument("--overlap-score-weight", type=float, default=OVERLAP_SCORE_WEIGHT,
                    help="--router kv: the weight of a prompt block still to prefill against a "
                         "block of load, in Dynamo's score (kv_index.score)")
    ap.add_argument("--prefill-target-queued-tokens", type=int,
                    default=d.prefill_target_queued_tokens)
    ap.add_argument("--decode-target-running", type=int, default=d.decode_target_running)
    ap.add_argument("--decode-target-kv-usage", type=float, default=d.decode_target_kv_usage)
    ap.add_argument("--upscale-delay-s", type=float, default=d.upscale_delay_s)
    ap.add_argument("--downscale-delay-s", type=float, default=d.downscale_delay_s)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
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
    args = ap.parse_args(argv)
    try:
        (p_lo, p_hi), (d_lo, d_hi) = parse_range(args.prefill), parse_range(args.decode)
        targets = FleetTargets(p_lo, p_hi, d_lo, d_hi, args.prefill_target_queued_tokens,
                               args.decode_target_running, args.decode_target_kv_usage,
                               args.upscale_delay_s, args.downscale_delay_s)
    except ValueError as e:
        ap.error(str(e))
    config = FleetConfig(model=args.model, kv_connector=args.kv_connector, seed=args.seed,
                         server_args=args.server_args.split(),
                         replica_num_cpus=args.replica_num_cpus,
                         api_keys=api_keys_from(args.api_key),
                         secure=args.secure, router=args.router,
                         pd_min_uncached_tokens=args.pd_min_uncached_tokens,
                         overlap_score_weight=args.overlap_score_weight,
                         kv_store_url=args.kv_store_url,
                         shared_storage_path=args.shared_storage_path)
    stop = {"now": False}

    def on_signal(signum, _frame):
        stop["now"] = True
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_signal)
    fleet = None
    try:
        fleet = start_fleet(config, targets, port=args.port, host=args.host,
                            address=args.address, startup_timeout=args.startup_timeout)
        signal.signal(signal.SIGTERM, on_signal)     # ray.init installed its own: ours again
        print(f"fleet: {fleet.url}   (GET {fleet.url}/fleet)")
        if not fleet._started_serve:
            print(f"fleet: Ray Serve was already running here: the ingress is on its HTTP proxy, "
                  f"{fleet.url}", flush=True)
        view = fleet.view()
        view["decisions"] = view["decisions"][-1:]
        print("FLEET " + json.dumps(view), flush=True)
        while not stop["now"]:
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
