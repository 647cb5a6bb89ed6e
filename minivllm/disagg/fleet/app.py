"""The fleet as the Ray Serve application it deploys: its configuration and checks (no Ray needed),
the application config (``app_config``) and the builder Serve imports from it (``fleet_app``), in
the place of Ray Serve LLM's ``build_pd_openai_app`` (Ray 2.60's
``ray/llm/_internal/serve/serving_patterns/prefill_decode/builder.py``), which builds vLLM engines
and cannot build ours.

Serve takes an application-level ``autoscaling_policy`` only from a config, which it keeps in Ray's
GCS and shows to anyone who reads it (``serve config``, the dashboard). So no key goes into it:
``FleetState`` holds the clients' API keys and the fleet's Redis password (``keys()``), and the
ingress and each replica ask it when they start.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from minivllm.disagg.fleet.autoscale import FleetTargets
from minivllm.disagg.fleet.kv_index import OVERLAP_SCORE_WEIGHT
from minivllm.disagg.fleet.replicas import APP, NAMESPACE, ROLES

CONNECTORS = ("ZmqPullConnector", "RedisStoreConnector", "SharedStorageConnector")
ROUTER_NAMES = ("kv", "round_robin", "serve")
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
# How often each replica tells the routers where its KV events are (and its block size).
ROUTING_STATS_PERIOD_S = 1.0
# Serve admits ``max_ongoing_requests`` calls per replica (default 5) and queues the rest. The
# ingress only awaits I/O, and the engines bound real work themselves (``--max-pending-requests``,
# 256, then a 503), so neither Serve queue should be what holds requests back.
INGRESS_MAX_ONGOING_REQUESTS = 256
REPLICA_MAX_ONGOING_REQUESTS = 1000
# A node offers ``{"prefill": 1}``; a replica asks for a sliver of it, so the resource says where a
# role may run without capping how many replicas one node carries.
ROLE_RESOURCE_PER_REPLICA = 0.001
# Serve kills a stopping replica after its drain limit plus this: the engine's own stop.
ENGINE_STOP_S = 10.0


class FleetConfigError(ValueError):
    """A fleet the command refuses to start; the message says what to change."""


@dataclass
class FleetConfig:
    """What every replica needs; sent to them as the application's ``args``, less the keys."""
    model: str
    kv_connector: str = "ZmqPullConnector"
    seed: int = 0
    server_args: list = field(default_factory=list)    # extra ``minivllm serve`` flags
    replica_num_cpus: float = 1.0      # Ray's logical CPUs per engine replica = its torch threads
    by_role: bool = True               # place replicas by the nodes' prefill/decode resource
    node_ip: bool = True               # bind the node's address (False: 127.0.0.1, one machine)
    api_keys: list = field(default_factory=list)       # the clients' keys: never in ``args``
    secure: bool = False               # the fleet's own Redis store gets a random password
    kv_store_url: Optional[str] = None  # a store the user runs; None: the fleet starts one
    shared_storage_path: Optional[str] = None
    kv_extra_config: dict = field(default_factory=dict)
    metrics_interval_s: float = 0.5
    look_back_period_s: float = 1.0
    router: str = "kv"                 # kv | round_robin | serve (kv_router.py)
    # Decode is picked first; when it holds all but this many prompt tokens it computes them
    # itself. 64: about a chat turn's new message, a chunk too small to stall its running decodes
    # for long and far cheaper than a remote prefill's round trip. 0: always a remote prefill.
    pd_min_uncached_tokens: int = 64
    overlap_score_weight: float = OVERLAP_SCORE_WEIGHT    # Dynamo's (kv_index.score)
    drain_timeout_s: float = 60.0      # a replica's drain at most (then Serve stops it anyway)
    state_actor: str = ""              # FleetState's name


def parse_range(text: str) -> tuple[int, int]:
    """``MIN:MAX`` or ``N``."""
    lo, _, hi = str(text).partition(":")
    try:
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise FleetConfigError(f"a role's size is MIN:MAX or N, got {text!r}.") from None
    if not 0 <= lo <= hi or hi < 1:
        raise FleetConfigError(f"need 0 <= MIN <= MAX and MAX >= 1, got {text!r}.")
    return lo, hi


def check_config(config: FleetConfig) -> None:
    """Refuse what no replica could run, before Ray starts."""
    from minivllm.distributed.kv_transfer.redis_store_connector import URL_SCHEMES
    c = config
    for bad, why in (
            (c.kv_connector not in CONNECTORS, f"kv_connector must be one of {CONNECTORS}, got "
                                               f"{c.kv_connector!r}."),
            (c.kv_store_url and c.kv_connector != "RedisStoreConnector",
             f"--kv-store-url is RedisStoreConnector's, not {c.kv_connector}'s."),
            (c.kv_store_url and not c.kv_store_url.startswith(URL_SCHEMES),
             f"--kv-store-url must start with one of {URL_SCHEMES}."),
            (c.router not in ROUTER_NAMES,
             f"router must be one of {ROUTER_NAMES}, got {c.router!r}."),
            (c.pd_min_uncached_tokens < 0,
             "pd_min_uncached_tokens must be >= 0 (0: always remote)."),
            (c.overlap_score_weight < 0, "overlap_score_weight must be >= 0 (0: load alone).")):
        if bad:
            raise FleetConfigError(why)


def app_config(config: FleetConfig, targets: FleetTargets) -> dict:
    """The fleet as one application of a ``ServeDeploySchema``; ``api_keys`` are left out."""
    args = {k: v for k, v in asdict(config).items() if k != "api_keys"}
    policy = {"policy_function": "minivllm.disagg.fleet.autoscale:FleetAutoscalingPolicy",
              "policy_kwargs": {**asdict(targets), "state_actor": config.state_actor,
                                "namespace": NAMESPACE}}
    return {"name": APP, "route_prefix": "/", "import_path": "minivllm.disagg.fleet.app:fleet_app",
            "args": {"config": args, "targets": asdict(targets)}, "autoscaling_policy": policy}


def http_options(host: Optional[str], port: Optional[int], running: Optional[dict]) -> dict:
    """Serve's ``http_options`` for the ingress (Serve applies them only when it starts).
    ``running``: the host and port of a Serve already running, else None; asking it for others
    is a ``FleetConfigError`` naming them. Port 0: the caller picks a free one."""
    if running is None:
        return {"host": host or DEFAULT_HOST, "port": DEFAULT_PORT if port is None else port}
    clash = [f"--{k} {v}" for k, v in (("host", host), ("port", port or None))
             if v is not None and v != running[k]]
    if clash:
        raise FleetConfigError(
            f"Ray Serve already runs on this cluster, its HTTP proxy on {running['host']}:"
            f"{running['port']}, and Serve fixes its HTTP options when it starts: the fleet's "
            f"ingress cannot get {' '.join(clash)}. Run the fleet with --host {running['host']} "
            f"--port {running['port']} (or without them), or stop Serve first (`serve shutdown`, "
            "which stops every application on it) to start it on yours.")
    return dict(running)


def fleet_app(args: dict) -> Any:
    """The builder Serve imports from the config: the ``prefill`` and ``decode`` deployments, each
    with its role's request router (kv_router.py), and the ingress, which gets their handles."""
    from ray import serve

    from minivllm.disagg.fleet.ingress import FleetIngress
    from minivllm.disagg.fleet.kv_router import ROUTERS
    from minivllm.disagg.fleet.replicas import EngineReplica
    config, targets = args["config"], FleetTargets(**args["targets"])
    replicas = []
    for role in ROLES:
        lo, hi = getattr(targets, f"{role}_min"), getattr(targets, f"{role}_max")
        actor = {"num_cpus": config["replica_num_cpus"]}
        if config["by_role"]:
            actor["resources"] = {role: ROLE_RESOURCE_PER_REPLICA}
        router = ROUTERS[config["router"]]       # None: Serve's default router
        routing = {"request_router_config": {
            "request_router_class": router, "request_router_kwargs": {"pool": role},
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}} if router else {}
        replicas.append(serve.deployment(
            EngineReplica, name=role, ray_actor_options=actor, **routing,
            max_ongoing_requests=REPLICA_MAX_ONGOING_REQUESTS,
            # Serve's own delays are 0: the policy applies the fleet's (autoscale.decide).
            autoscaling_config={"min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
                                "metrics_interval_s": config["metrics_interval_s"],
                                "look_back_period_s": config["look_back_period_s"],
                                "upscale_delay_s": 0.0, "downscale_delay_s": 0.0},
            graceful_shutdown_timeout_s=config["drain_timeout_s"] + ENGINE_STOP_S,
            graceful_shutdown_wait_loop_s=0.5).bind(role, config))
    # ``serve.ingress()`` with no app: the ingress builds its app once it runs, after it has asked
    # FleetState for the keys (FleetIngress.__serve_build_asgi_app__).
    ingress = serve.deployment(serve.ingress()(FleetIngress), name="ingress", num_replicas=1,
                               max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(config, *replicas)
