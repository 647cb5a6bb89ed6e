"""The fleet as the Ray Serve application it deploys: ``fleet_app`` is the builder Serve imports from
the application's config (``import_path``, fleet_config.app_config): the ``prefill`` and ``decode``
deployments (fleet_replicas.EngineReplica, each with its role's request router: kv_router.py) and the
ingress (fleet_ingress.FleetIngress), with the constants that size them.
"""
from __future__ import annotations

from minivllm.disagg.autoscale import FleetTargets
from minivllm.disagg.fleet_replicas import ROLES

# How often each replica reports where its KV events are (and its block size) to the routers.
ROUTING_STATS_PERIOD_S = 1.0
# Serve lets a replica take at most ``max_ongoing_requests`` calls at once (default 5) and queues
# the rest in front of it. The ingress only awaits I/O (two HTTP streams per request), so that
# default would admit 5 requests at a time to the whole fleet; the engines bound real work
# themselves (``--max-pending-requests``, 256: a 503 beyond it), so the ingress admits as many.
INGRESS_MAX_ONGOING_REQUESTS = 256
# An engine replica's own limit is its engine's (``--max-pending-requests``, 256, then a 503):
# Serve's queue in front of it should never be the one that holds requests back.
REPLICA_MAX_ONGOING_REQUESTS = 1000
# A node offers ``{"prefill": 1}``: a replica asks for a sliver of it, so the resource tags where
# a role may run without capping how many replicas one node carries (up to 1 / this).
ROLE_RESOURCE_PER_REPLICA = 0.001
# Serve kills a stopping replica after ``graceful_shutdown_timeout_s``: the drain's own limit plus
# the time the engine then needs to stop (its loop, its connector, its HTTP server).
ENGINE_STOP_S = 10.0


def fleet_app(args: dict):
    """The application builder Serve imports from the config (``import_path``)."""
    from ray import serve

    from minivllm.disagg.fleet_ingress import FleetIngress
    from minivllm.disagg.fleet_replicas import EngineReplica
    from minivllm.disagg.kv_router import ROUTERS
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

    # Late-bound (``serve.ingress()``): the ingress builds its app once it runs, after it has
    # asked FleetState for the keys (fleet_replicas.FleetIngress).
    ingress = serve.deployment(serve.ingress()(FleetIngress), name="ingress", num_replicas=1,
                               max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(config, *replicas)
