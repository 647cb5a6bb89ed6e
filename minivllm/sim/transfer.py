"""The KV transfer between prefill and decode replicas in virtual time: what to move and what to
hold is decided by the real connector's scheduler half, only the move's duration is simulated.
Beside vLLM's ``NixlConnector`` pull flow (vllm/distributed/kv_transfer/kv_connector/v1/nixl/),
which minivllm's ``ZmqPullConnector`` mirrors (distributed/kv_transfer/zmq_pull_connector.py); the
article's step "Disaggregated P/D", run by the fleet simulator (sim/fleet.py).

- ``TransferCost``: one pull's time, ``latency_s + bytes / bandwidth``, with the bytes from the
  model's KV size per token (``kv_bytes_per_token``: layers x 2 (K, V) x KV heads x head dim x
  dtype bytes; SmolLM2-135M in float32: 30 x 2 x 3 x 64 x 4 = 46,080 bytes). ``TRANSFER_COSTS``
  holds the costs measured on this machine for the connectors, and networks to plan for.
- ``SimPullConnector``: ``ZmqPullConnector`` whose scheduler half runs unchanged
  (``get_num_new_matched_tokens``: every prompt token beyond D's local hit is pulled,
  asynchronously; ``update_state_after_alloc``; ``build_connector_meta``; ``request_finished``: P
  holds the blocks for D), and whose two network calls (P's ``hold``, D's ``done``) and worker
  half (the pulls, ``get_finished``) go to a ``KVTransferHub`` in virtual time instead of a
  ZeroMQ side channel. So P's KV cache stays occupied until D has read it, D's request waits in
  ``WAITING_FOR_REMOTE_KVS`` while other requests keep decoding, exactly as in the real fleet.
- ``KVTransferHub``: the simulated side channel shared by one fleet's replicas: a pull waits for
  one of D's ``num_pull_threads`` (the connector's default, 2), takes ``TransferCost.time_s``,
  then D reports ``finished_recving`` and P ``finished_sending`` in their next steps.

Left out: a lease that expires before D reads (the simulated pull always completes), failed
pulls, and network contention (each pull gets the whole bandwidth).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from minivllm.distributed.kv_transfer.factory import KVConnectorFactory
from minivllm.distributed.kv_transfer.zmq_pull_connector import ZmqPullConnector

SIM_CONNECTOR = "SimPullConnector"
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: str = "float32") -> int:
    """Bytes of KV cache one token holds: layers x 2 (K and V) x KV heads x head dim x dtype bytes
    (the rows a pull moves; vLLM's ``get_kv_cache_spec`` page size divided by the block size)."""
    return num_layers * 2 * num_kv_heads * head_dim * _DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class TransferCost:
    """One KV pull's time: ``latency_s + num_bytes / bandwidth_bytes_per_s``."""
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0
    name: str = ""
    source: str = ""           # where the numbers come from

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or self.latency_s < 0:
            raise ValueError("a transfer needs a bandwidth > 0 and a latency >= 0, got "
                             f"{self.bandwidth_bytes_per_s} B/s and {self.latency_s} s.")

    def time_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s

    def describe(self) -> str:
        return (f"{self.name or 'transfer'}: {self.bandwidth_bytes_per_s / 1e9:.3g} GB/s, "
                f"{self.latency_s * 1e3:.3g} ms per pull")

    @classmethod
    def parse(cls, text: str) -> "TransferCost":
        """A name of ``TRANSFER_COSTS``, or ``GBPS[:LATENCY_MS]`` (``"12.5:0.05"``: 100 Gbit/s,
        50 us)."""
        if text in TRANSFER_COSTS:
            return TRANSFER_COSTS[text]
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(?::\s*([0-9.eE+-]+)\s*)?", str(text))
        if m is None:
            raise ValueError(f"--transfer is one of {sorted(TRANSFER_COSTS)} or GBPS[:LATENCY_MS], "
                             f"got {text!r}.")
        gbps, lat_ms = float(m.group(1)), float(m.group(2) or 0.0)
        return cls(gbps * 1e9, lat_ms / 1e3, name=f"{gbps:g} GB/s + {lat_ms:g} ms")


# Measured on this machine (2-core CPU, SmolLM2-135M, float32, 46,080 bytes per token) with
# ``python -m minivllm.bench pd --lengths 256,1024,2048 --no-redis --itl-prompt 0`` (2026-12-07,
# load average about 1.5), each connector's own load time (its ``load_time_s`` stat) against the
# bytes it moved, fitted as a line:
# - zmq_pull: 11.3 / 45.0 / 90.0 MiB pulled at 312 / 413 / 549 MiB/s (36 / 109 / 164 ms):
#   25 ms (the handshake and one read round trip per layer) + bytes / 624 MiB/s;
# - shared_storage: 10.6 / 44.3 / 89.3 MiB loaded at 970 / 1,063 / 1,010 MiB/s (11 / 42 / 88
#   ms): 0.5 ms + bytes / 1,016 MiB/s (the load only; P's store is not counted).
# Networks to plan for: the wire's bandwidth and a round trip; an RDMA read (NIXL) gets close.
TRANSFER_COSTS: dict[str, TransferCost] = {
    "zmq_pull": TransferCost(624 * 2**20, 25e-3, "zmq_pull",
                             "bench pd, ZmqPullConnector, this machine (loopback TCP)"),
    "shared_storage": TransferCost(1016 * 2**20, 0.5e-3, "shared_storage",
                                   "bench pd, SharedStorageConnector load, this machine"),
    "ethernet_25g": TransferCost(25e9 / 8, 50e-6, "ethernet_25g", "25 Gbit/s, 50 us"),
    "ethernet_100g": TransferCost(100e9 / 8, 20e-6, "ethernet_100g", "100 Gbit/s, 20 us"),
    "infiniband_400g": TransferCost(400e9 / 8, 5e-6, "infiniband_400g",
                                    "400 Gbit/s RDMA, 5 us"),
    "free": TransferCost(math.inf, 0.0, "free", "no transfer cost (an upper bound for P/D)"),
}


class KVTransferHub:
    """The simulated side channel of one fleet: which P holds which request's blocks, the pulls in
    flight, and what each replica's worker half reports next. ``env``: the SimPy environment;
    ``bytes_per_token``: the model's KV size per token; ``on_ready(engine_id)``: called when a
    replica has something to report (the fleet wakes it up)."""

    def __init__(self, env: Any, cost: TransferCost, bytes_per_token: int, block_size: int,
                 on_ready: Callable[[str], None], num_pull_threads: int = 2) -> None:
        import simpy
        self.env, self.cost = env, cost
        self.bytes_per_token, self.block_size = bytes_per_token, block_size
        self.on_ready = on_ready
        self.num_pull_threads = num_pull_threads
        self._links: dict[str, Any] = {}               # D engine id -> simpy.Resource (threads)
        self._simpy = simpy
        self.held: dict[tuple[str, str], list[int]] = {}     # (P engine, req) -> blocks held
        self.sending_done: dict[str, set[str]] = {}          # P engine -> reqs D finished reading
        self.recving_done: dict[str, set[str]] = {}          # D engine -> reqs pulled
        self.num_pulls = 0
        self.bytes_moved = 0
        self.pull_time_s = 0.0

    def hold(self, engine_id: str, req_id: str, block_ids: list[int]) -> bool:
        """P's ``hold``: the blocks stay P's until D's ``done``."""
        self.held[(engine_id, req_id)] = list(block_ids)
        return True

    def done(self, engine_id: str, req_id: str) -> None:
        """D's ``done`` (read everything, or gave up): P reports ``finished_sending`` next step."""
        if self.held.pop((engine_id, req_id), None) is not None:
            self.sending_done.setdefault(engine_id, set()).add(req_id)
            self.on_ready(engine_id)

    def start_pull(self, dst_engine: str, req: Any) -> None:
        """D's worker half starts one ``RecvReqMeta`` pull (async: the step does not wait)."""
        self.env.process(self._pull(dst_engine, req))

    def _pull(self, dst_engine: str, req: Any):
        link = self._links.get(dst_engine)
        if link is None:
            link = self._links[dst_engine] = self._simpy.Resource(self.env, self.num_pull_threads)
        with link.request() as slot:
            yield slot
            num_bytes = len(req.remote_block_ids) * self.block_size * self.bytes_per_token
            dt = self.cost.time_s(num_bytes)
            yield self.env.timeout(dt)
        self.num_pulls += 1
        self.bytes_moved += num_bytes
        self.pull_time_s += dt
        self.recving_done.setdefault(dst_engine, set()).add(req.req_id)
        self.on_ready(dst_engine)
        self.done(req.remote_engine_id, req.remote_request_id)

    def take_finished(self, engine_id: str) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """What ``engine_id``'s worker half reports this step: (finished_sending,
        finished_recving), each None when empty (as ``get_finished`` returns them)."""
        sent = self.sending_done.pop(engine_id, None)
        recvd = self.recving_done.pop(engine_id, None)
        return sent or None, recvd or None

    def has_pending(self, engine_id: str) -> bool:
        return bool(self.sending_done.get(engine_id) or self.recving_done.get(engine_id))


class SimPullConnector(ZmqPullConnector):
    """``ZmqPullConnector`` with its scheduler half unchanged and its network in virtual time.

    ``kv_connector_extra_config``: ``engine_id`` (the replica's name), ``side_channel_port`` (any
    number: nothing binds it), ``sim_hub`` (the fleet's ``KVTransferHub``)."""

    def _init_worker_state(self) -> None:
        """No side channel, no threads: the hub plays both."""
        self._hub: KVTransferHub = self._kv_transfer_config.kv_connector_extra_config["sim_hub"]
        self._kv_caches = {}

    # ------------------------------------------------------------------ the network, simulated
    def _hold(self, req_id: str, block_ids: list[int]) -> bool:
        return self._hub.hold(self._engine_id, req_id, block_ids)

    def _send_done(self, params: dict) -> None:
        self._hub.done(params.get("remote_engine_id"), params.get("remote_request_id"))

    # ------------------------------------------------------------------ worker half, simulated
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """D: each of this step's pulls starts now and lands after its ``TransferCost``."""
        md = self._connector_metadata
        for req in (md.reqs_to_recv if md is not None else []):
            self._hub.start_pull(self._engine_id, req)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a pulled request runs only after ``finished_recving``."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """P saves nothing: D reads P's blocks where they are."""

    def wait_for_save(self) -> None:
        """Nothing is written anywhere on P."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]],
                                                                Optional[set[str]]]:
        return self._hub.take_finished(self._engine_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def shutdown(self) -> None:
        return


def register() -> None:
    """``kv_connector="SimPullConnector"`` in the connector registry (once)."""
    if SIM_CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(SIM_CONNECTOR, SimPullConnector)


def sim_kv_transfer_config(role: str, engine_id: str, hub: KVTransferHub) -> dict:
    """The ``kv_transfer_config`` of a simulated replica: ``role`` "prefill" (producer) or
    "decode" (consumer), as the fleet's replicas get theirs (disagg/fleet/replicas.py)."""
    register()
    return {"kv_connector": SIM_CONNECTOR,
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_connector_extra_config": {"engine_id": engine_id, "side_channel_port": 1,
                                          "sim_hub": hub}}


__all__ = ["KVTransferHub", "SIM_CONNECTOR", "SimPullConnector", "TRANSFER_COSTS", "TransferCost",
           "kv_bytes_per_token", "register", "sim_kv_transfer_config"]
