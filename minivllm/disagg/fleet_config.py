"""What ``python -m minivllm.disagg.fleet`` decides before it deploys anything, without Ray: the
fleet's configuration and its checks, the Serve application config it deploys, and the HTTP
address its ingress gets.

- ``app_config``: the one application of the ``ServeDeploySchema`` the fleet deploys (Ray Serve
  takes an application-level ``autoscaling_policy`` only from a config). Serve keeps that config in
  Ray's GCS and shows it to anyone who can read it (``serve config``, the dashboard), so the keys
  (``SECRETS``: the clients' ``api_keys``) are left out of it: ``FleetState``, the fleet's named actor, holds them, and the ingress and every
  replica ask it when they start (as the replicas ask ``FleetStore`` for the store's password).
- ``http_options``: Serve's HTTP proxy is the ingress, and Serve applies ``http_options`` only when
  it starts. On a cluster where Serve already runs, the fleet's ingress is on that Serve's host and
  port; asking for another one is an error that names the running one.

Nothing here imports ``ray``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from minivllm.disagg.fleet_replicas import APP_NAME as APP, NAMESPACE  # noqa: F401
from minivllm.disagg.kv_index import OVERLAP_SCORE_WEIGHT

CONNECTORS = ("ZmqPullConnector", "RedisStoreConnector", "SharedStorageConnector")
POLICY = "minivllm.disagg.autoscale:FleetAutoscalingPolicy"
IMPORT_PATH = "minivllm.disagg.fleet_app:fleet_app"
SECRETS = ("api_keys",)          # never in the deployed config (FleetState.keys)
ROUTER_NAMES = ("kv", "round_robin", "serve")
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


class FleetConfigError(ValueError):
    """A fleet the command refuses to start; the message says what to change."""


@dataclass
class FleetConfig:
    """Everything a replica needs. Sent to every node as the application's ``args``, less
    ``SECRETS``, which the replicas and the ingress ask of ``FleetState``."""
    model: str
    kv_connector: str = "ZmqPullConnector"
    seed: int = 0
    server_args: list = field(default_factory=list)    # extra ``minivllm serve`` flags
    replica_num_cpus: float = 1.0      # Ray's logical CPUs per engine replica = its torch threads
    by_role: bool = True               # place replicas by the nodes' ``prefill``/``decode`` resource
    node_ip: bool = True               # bind the node's address (False: 127.0.0.1, one machine)
    api_keys: list = field(default_factory=list)       # the ingress's clients' keys
    secure: bool = False               # the fleet's own KV store gets a random password
    kv_store_url: Optional[str] = None  # a store the user runs; None: the fleet starts one
    kv_store_actor: str = ""           # the fleet's own store (the replicas ask it its password)
    shared_storage_path: Optional[str] = None
    kv_extra_config: dict = field(default_factory=dict)
    metrics_interval_s: float = 0.5
    look_back_period_s: float = 1.0
    router: str = "kv"                 # kv | round_robin | serve (kv_router.py)
    # The decode replica computes the rest itself when it holds all but this many prompt tokens
    # (decode is picked first). 64: about one chat turn's new message, a prefill chunk small
    # enough not to stall the replica's running decodes for long, and far cheaper than a remote
    # prefill's round trip and KV transfer. 0: every request is prefilled remotely.
    pd_min_uncached_tokens: int = 64
    # Dynamo's ``overlap_score_weight``: a prompt block still to prefill against a block of load
    # (kv_index.score). See kv_index.OVERLAP_SCORE_WEIGHT for this default.
    overlap_score_weight: float = OVERLAP_SCORE_WEIGHT
    drain_timeout_s: float = 60.0      # a replica's drain at most (then Serve stops it anyway)
    state_actor: str = ""              # FleetState: membership, decisions, the keys


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = str(text).partition(":")
    try:
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise FleetConfigError(f"a role's size is MIN:MAX or N, got {text!r}.") from None
    if not 0 <= bounds[0] <= bounds[1] or bounds[1] < 1:
        raise FleetConfigError(f"need 0 <= MIN <= MAX and MAX >= 1, got {text!r}.")
    return bounds


def check_config(config: FleetConfig) -> None:
    """Refuse what no replica could run, before Ray starts."""
    from minivllm.distributed.kv_transfer.redis_store_connector import URL_SCHEMES
    if config.kv_connector not in CONNECTORS:
        raise FleetConfigError(
            f"kv_connector must be one of {CONNECTORS}, got {config.kv_connector!r}.")
    if config.kv_store_url and config.kv_connector != "RedisStoreConnector":
        raise FleetConfigError(
            f"--kv-store-url is RedisStoreConnector's, not {config.kv_connector}'s.")
    if config.router not in ROUTER_NAMES:
        raise FleetConfigError(f"router must be one of {ROUTER_NAMES}, got {config.router!r}.")
    if config.pd_min_uncached_tokens < 0:
        raise FleetConfigError("pd_min_uncached_tokens must be >= 0 (0: always a remote prefill).")
    if config.overlap_score_weight < 0:
        raise FleetConfigError("overlap_score_weight must be >= 0 (0: load alone decides).")
    if config.kv_store_url and not config.kv_store_url.startswith(URL_SCHEMES):
        raise FleetConfigError(f"--kv-store-url must start with one of {URL_SCHEMES}.")


def fleet_keys(config: FleetConfig) -> dict:
    """What ``FleetState`` holds for the ingress and the replicas (``FleetState.keys``)."""
    return {"api_keys": list(config.api_keys)}


def app_config(config: FleetConfig, targets: Any) -> dict:
    """The fleet as one application of a ``ServeDeploySchema`` (``targets``: the policy's
    ``autoscale.FleetTargets``). No key of ``SECRETS`` is in it."""
    args = {k: v for k, v in asdict(config).items() if k not in SECRETS}
    policy = {"policy_function": POLICY, "policy_kwargs": {
        **asdict(targets), "state_actor": config.state_actor, "namespace": NAMESPACE}}
    return {"name": APP, "route_prefix": "/", "import_path": IMPORT_PATH,
            "args": {"config": args, "targets": asdict(targets)}, "autoscaling_policy": policy}


def http_options(host: Optional[str], port: Optional[int], running: Optional[dict]) -> dict:
    """Serve's ``http_options`` for the ingress. ``host``/``port``: what was asked for (None, or
    port 0: nothing); ``running``: ``{"host", "port"}`` of the Serve already running on the
    cluster, else None. Serve not running: the asked ones (port None: ``DEFAULT_PORT``; 0: the
    caller picks a free one). Serve running: its own, which it keeps until it stops; asking for
    others raises ``FleetConfigError`` naming them."""
    if running is None:
        return {"host": host or DEFAULT_HOST, "port": DEFAULT_PORT if port is None else port}
    asked = {"host": host, "port": port or None}
    clash = [f"--{k} {v}" for k, v in asked.items() if v is not None and v != running[k]]
    if clash:
        raise FleetConfigError(
            f"Ray Serve already runs on this cluster, its HTTP proxy on {running['host']}:"
            f"{running['port']}, and Serve's HTTP options are fixed when Serve starts: the "
            f"fleet's ingress cannot get {' '.join(clash)}. Run the fleet with --host "
            f"{running['host']} --port {running['port']} (or without them), or stop Serve first "
            "(`serve shutdown`, which stops every application on it) to start it on yours.")
    return {"host": running["host"], "port": running["port"]}
