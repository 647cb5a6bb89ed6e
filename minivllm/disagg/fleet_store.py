"""The fleet's own KV store for ``RedisStoreConnector`` (article: "Prefill workers write KV to a
dedicated KV-cache service; decode workers read from it").

When the fleet runs ``RedisStoreConnector`` and no ``--kv-store-url`` names a store the user
started, ``start_store`` starts one: ``FleetStore``, a Ray actor pinned to the node that started
the fleet (beside ``FleetState``), runs ``kvstore.RedisServer`` as its child process on TCP, bound
to that node's address as Ray sees it (``ray.util.get_node_ip_address()``), on a free port. Every
replica, on any node, reaches it at ``redis://HOST:PORT/0``.

- The fleet stops it (``stop_store``: ``RedisServer.stop``, SIGTERM by PID, then the actor) when it
  stops: ``Fleet.stop()``, the command's SIGTERM or Ctrl-C. Should the actor's worker be killed
  instead (``ray.kill``, its job ending), Ray's ``kill_child_processes_on_worker_exit`` (on by
  default) takes the redis-server child with it.
- ``--secure``: a random password (``requirepass``). The replicas read it from this actor by name
  at start (``password()``), so it is never written into the Serve application's config, which
  Serve keeps in Ray's GCS and shows to anyone reading it (``serve config``, the dashboard). An
  actor call crosses only Ray's own control plane, whose clients can already run code on every
  node. A file cannot carry it: the replicas' nodes do not share one.
- Without ``--secure``, a store bound beyond 127.0.0.1 has no password: the fleet warns
  (``kvstore.unguarded_warning``), as ``python -m minivllm.kvstore`` does, and runs. It is the same
  posture as the replicas' HTTP servers, which also answer anyone without ``--secure``.

Nothing here imports ``ray`` at module level (see ``fleet_replicas``).
"""
from __future__ import annotations

import secrets
import uuid
import warnings
from typing import Any, Optional

from minivllm.kvstore import RedisServer, unguarded_warning


def needs_own_store(kv_connector: str, kv_store_url: Optional[str]) -> bool:
    """The fleet starts a store for ``RedisStoreConnector`` when the user named none."""
    return kv_connector == "RedisStoreConnector" and not kv_store_url


def describe(connector: str, url: Optional[str], started_by_fleet: bool = False,
             password: bool = False, path: Optional[str] = None) -> dict:
    """What ``GET /fleet`` says of the KV path: the store's URL never carries a password."""
    from minivllm.distributed.kv_transfer.redis_store import redacted
    return {"connector": connector, "url": redacted(url) if url else None, "path": path,
            "started_by_fleet": started_by_fleet, "password": password}


class FleetStore:
    """The Ray actor (``num_cpus=0``) that owns the fleet's ``redis-server``: ``info()`` names it,
    ``password()`` hands the replicas its password, ``stop()`` stops it by PID."""

    def __init__(self, node_ip: bool, password: Optional[str]) -> None:
        import ray

        from minivllm.disagg.launch import free_port
        host = ray.util.get_node_ip_address() if node_ip else "127.0.0.1"
        self._password = password
        self.server = RedisServer(port=free_port(host), host=host, password=password).start()

    def info(self) -> dict:
        return {"url": self.server.url_without_password, "host": self.server.host,
                "pid": self.server.pid, "password": self._password is not None}

    def password(self) -> Optional[str]:
        return self._password

    def stop(self) -> None:
        self.server.stop()


def start_store(secure: bool, node_ip: bool, scheduling_strategy: Any,
                namespace: str) -> tuple[Any, dict]:
    """Start the fleet's store on this node: ``(actor, info)``, ``info["name"]`` the actor's name
    the replicas look it up by. Warns when it is reachable from other machines with no password."""
    import ray
    name = f"fleet-store-{uuid.uuid4().hex[:8]}"
    password = secrets.token_urlsafe(24) if secure else None
    actor = ray.remote(FleetStore).options(
        name=name, namespace=namespace, num_cpus=0,
        scheduling_strategy=scheduling_strategy).remote(node_ip, password)
    try:
        info = dict(ray.get(actor.info.remote()), name=name)
    except BaseException:
        ray.kill(actor)
        raise
    fix = "pass --secure (a random password only the fleet's replicas get)"
    if (msg := unguarded_warning(info["host"], password, fix)) is not None:
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return actor, info


def stop_store(actor: Any, timeout_s: float = 30.0) -> None:
    """Stop the store's server (SIGTERM by PID, its folder removed), then its actor."""
    import ray
    try:
        ray.get(actor.stop.remote(), timeout=timeout_s)
    finally:
        ray.kill(actor)
