"""P/D as vLLM mostly deploys it: the decode instance (D) reads the KV straight out of the prefill
instance's (P) paged memory. vLLM: ``NixlConnector``'s pull flow,
vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py (this file, the scheduler
half) and pull_worker.py (``zmq_pull_worker.py``, the worker half); NIXL/RDMA is replaced by a
ZeroMQ side channel over TCP (``pyzmq``, the library vLLM's own side channel uses).

The flow, with vLLM's names:
1. P gets the request with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True}``.
   When it finishes (``FINISHED_LENGTH_CAPPED`` or ``FINISHED_STOPPED``), ``request_finished``
   registers the blocks of its computed tokens with P's worker (a lease of ``kv_lease_duration``
   seconds) and returns ``(True, params)``: the scheduler keeps the blocks. ``params``:
   ``do_remote_prefill=True``, ``do_remote_decode=False``, ``remote_block_ids`` (one list per
   KV-cache group, as vLLM: ``([3, 4, 5],)``; minivllm has one group),
   ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``,
   ``remote_num_tokens``, ``remote_blocks_expiry_time`` (wall clock), ``tp_size=1``.
   Any other finish (an abort) frees the blocks at once.
2. D gets the original request with those params: ``get_num_new_matched_tokens`` returns
   ``(len(prompt) - local hit, True)``; the request waits in ``WAITING_FOR_REMOTE_KVS`` while D's
   worker pulls P's blocks (beyond D's local prefix hit) into its own, layer by layer, after a
   handshake (model, dtype, block size, KV layout). It reports ``finished_recving`` and the request
   runs (its last prompt token is recomputed, for the logits). D then tells P ``done``; P's worker
   reports ``finished_sending`` and P's scheduler frees the blocks.
3. Lease: blocks nobody finished reading within ``kv_lease_duration`` are freed (P logs which
   request expired). No heartbeat is built.
A pull that fails (P gone, refused, timed out, mismatch) reports D's blocks invalid:
``kv_load_failure_policy`` "recompute" computes the prompt on D, "fail" ends it with an error.

``kv_connector_extra_config``: ``side_channel_host`` ("127.0.0.1", the address P binds and
advertises), ``side_channel_port`` (0: a free port, chosen when the config is validated),
``timeout_s`` (5.0, every side-channel message), ``num_pull_threads`` (2: concurrent pulls on D),
``kv_lease_duration`` (where vLLM reads it; overrides ``KVTransferConfig.kv_lease_duration``),
``engine_id`` (default: a fresh id per instance), and the ``curve_*`` keys of
``zmq_pull_curve.py`` (CURVE: P serves only the decode instances whose public keys it allows).
"""
from __future__ import annotations

import json
import logging
import socket
import time
import uuid
import warnings
from typing import Any, Optional

from minivllm.distributed.kv_transfer import storage
from minivllm.distributed.kv_transfer.base import (KVConnectorBase_V1, KVConnectorRole,
                                                   checked_extra_config)
from minivllm.distributed.kv_transfer.zmq_pull_curve import CURVE_KEYS, validate_curve_config
from minivllm.distributed.kv_transfer.zmq_pull_metadata import RecvReqMeta, ZmqPullConnectorMetadata
from minivllm.distributed.kv_transfer.zmq_pull_worker import ZmqPullWorkerMixin, request

logger = logging.getLogger(__name__)
EXTRA_CONFIG_KEYS = ("side_channel_host", "side_channel_port", "timeout_s", "num_pull_threads",
                     "engine_id", "kv_lease_duration") + CURVE_KEYS   # CURVE: zmq_pull_curve.py
REMOTE_KEYS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
               "remote_port")
STATS = ("num_held", "num_leases_expired", "num_pulls", "num_loaded_tokens", "num_loaded_bytes",
         "load_time_s", "num_load_errors")


def remote_block_ids(params: dict[str, Any]) -> Optional[list[int]]:
    """P's block ids in ``kv_transfer_params``. vLLM sends one list per KV-cache group (a tuple,
    a list of lists once it went through JSON); a flat list of ids is read as the one group.
    None when P has more than one group: minivllm's cache has one."""
    ids = params["remote_block_ids"]
    if ids and all(isinstance(group, (list, tuple)) for group in ids):
        return list(ids[0]) if len(ids) == 1 else None
    return list(ids)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ZmqPullConnector(ZmqPullWorkerMixin, KVConnectorBase_V1):
    """Scheduler half here; worker half (side channel, pulls) in ``ZmqPullWorkerMixin``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        import zmq
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        extra = ktc.kv_connector_extra_config
        self._block_size = vllm_config.cache_config.block_size
        self._is_producer, self._is_consumer = ktc.is_kv_producer, ktc.is_kv_consumer
        self._host = extra.get("side_channel_host", "127.0.0.1")
        if not extra.get("side_channel_port"):
            extra["side_channel_port"] = free_port(self._host)
        self._port = int(extra["side_channel_port"])
        # Both halves of one instance must agree on the id P advertises (vLLM: engine_id).
        self._engine_id = extra.setdefault("engine_id", f"minivllm-{uuid.uuid4().hex[:12]}")
        self._timeout_s = float(extra.get("timeout_s", 5.0))
        self._num_pull_threads = int(extra.get("num_pull_threads", 2))
        # vLLM reads it from the extra config; minivllm also has it as a KVTransferConfig field.
        self._lease_s = float(extra.get("kv_lease_duration", ktc.kv_lease_duration))
        self._layout = storage.expected_layout(vllm_config)
        self._fp = storage.model_fingerprint(vllm_config)
        self._stats: dict[str, Any] = dict.fromkeys(STATS, 0)
        self._ctx = zmq.Context.instance()
        self._local_hit: dict[str, int] = {}
        self._reqs_to_recv: dict[str, RecvReqMeta] = {}
        self._init_worker_state()

    @classmethod
    def validate_kv_transfer_config(cls, ktc: Any) -> None:
        extra = checked_extra_config(ktc, EXTRA_CONFIG_KEYS, "ZmqPullConnector")
        name = "kv_transfer_config.kv_connector_extra_config"
        port = extra.get("side_channel_port", 0)
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
            raise ValueError(f"{name}['side_channel_port'] must be a TCP port (0 = pick a free one), "
                             f"got {port!r}.")
        for key in ("timeout_s", "kv_lease_duration"):
            t = extra.get(key, 5.0)
            if not isinstance(t, (int, float)) or isinstance(t, bool) or t <= 0:
                raise ValueError(f"{name}['{key}'] must be a positive number of seconds, got {t!r}.")
        n = extra.get("num_pull_threads", 2)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}['num_pull_threads'] must be an int >= 1, got {n!r}.")
        validate_curve_config(extra, ktc.is_kv_producer, ktc.is_kv_consumer)
        if not port:   # chosen now, so that both halves of this instance bind / advertise it
            ktc.kv_connector_extra_config = extra = dict(extra)   # not the caller's dict
            extra["side_channel_port"] = free_port(extra.get("side_channel_host", "127.0.0.1"))
            extra.setdefault("engine_id", f"minivllm-{uuid.uuid4().hex[:12]}")

    def _warn(self, msg: str) -> None:
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def get_stats(self) -> dict[str, Any]:
        return dict(self._stats)

    # ------------------------------------------------------------------ scheduler side, D
    def get_num_new_matched_tokens(self, request_: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """D: every prompt token beyond the local hit comes from P, asynchronously."""
        params = request_.kv_transfer_params or {}
        result = (0, False)
        if self._is_consumer and params.get("do_remote_prefill"):
            missing = [k for k in REMOTE_KEYS if k not in params]
            n = request_.num_prompt_tokens
            remote = None if missing else remote_block_ids(params)
            if missing:
                self._warn(f"ZmqPullConnector: {request_.request_id}: kv_transfer_params lack "
                           f"{missing}; recomputing the prompt.")
            elif remote is None:
                self._warn(f"ZmqPullConnector: {request_.request_id}: P sends "
                           f"{len(params['remote_block_ids'])} KV-cache groups, this cache has "
                           f"one; recomputing the prompt.")
            elif len(remote) < -(-n // self._block_size):
                self._warn(f"ZmqPullConnector: {request_.request_id}: P holds "
                           f"{len(remote)} blocks, the prompt needs "
                           f"{-(-n // self._block_size)}; recomputing the prompt.")
            elif n > num_computed_tokens:
                self._local_hit[request_.request_id] = num_computed_tokens
                result = (n - num_computed_tokens, True)
        self._record("get_num_new_matched_tokens", request_.request_id,
                     args={"num_computed_tokens": num_computed_tokens}, result=result)
        return result

    def update_state_after_alloc(self, request_: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request_.kv_transfer_params or {}
        hit = self._local_hit.pop(request_.request_id, None)
        if not params.get("do_remote_prefill") or hit is None or num_external_tokens == 0:
            return
        params["do_remote_prefill"] = False    # pulled once (vLLM): a preemption recomputes
        first, end = hit // self._block_size, -(-request_.num_prompt_tokens // self._block_size)
        local = blocks.get_block_ids()[0]
        meta = RecvReqMeta(request_.request_id, list(local[first:end]),
                           remote_block_ids(params)[first:end], params["remote_engine_id"],
                           params["remote_request_id"], params["remote_host"],
                           int(params["remote_port"]), num_external_tokens)
        self._reqs_to_recv[request_.request_id] = meta
        self._stats["num_pulls"] += 1
        self._record("update_state_after_alloc", request_.request_id,
                     args={"local_block_ids": meta.local_block_ids,
                           "remote_block_ids": meta.remote_block_ids})

    def build_connector_meta(self, scheduler_output: Any) -> ZmqPullConnectorMetadata:
        meta = ZmqPullConnectorMetadata(list(self._reqs_to_recv.values()))
        self._reqs_to_recv = {}
        if meta.reqs_to_recv:
            self._record("build_connector_meta", result=meta.describe())
        return meta

    # ------------------------------------------------------------------ scheduler side, P
    def request_finished(self, request_: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """P, after a normal finish of a ``do_remote_decode`` request: hold the blocks for D."""
        from minivllm.request import RequestStatus
        req_id = request_.request_id
        self._local_hit.pop(req_id, None)
        self._reqs_to_recv.pop(req_id, None)
        params = request_.kv_transfer_params or {}
        if params.get("do_remote_prefill") and params.get("remote_host"):
            self._send_done(params)    # D finished before its pull started: let P free now
        if (not self._is_producer or not params.get("do_remote_decode") or not block_ids
                or request_.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                           RequestStatus.FINISHED_STOPPED)):
            self._record("request_finished", req_id, args={"block_ids": list(block_ids)},
                         result=(False, None))
            return False, None
        if not self._hold(req_id, block_ids):
            return False, None
        self._stats["num_held"] += 1
        out = {"do_remote_prefill": True, "do_remote_decode": False,
               "remote_block_ids": (list(block_ids),), "remote_engine_id": self._engine_id,
               "remote_request_id": req_id, "remote_host": self._host, "remote_port": self._port,
               "remote_num_tokens": request_.num_computed_tokens, "tp_size": 1,
               "remote_blocks_expiry_time": time.time() + self._lease_s}
        self._record("request_finished", req_id, args={"block_ids": list(block_ids)},
                     result=(True, out))
        return True, out

    def _hold(self, req_id: str, block_ids: list[int]) -> bool:
        """Register the blocks with P's own worker half (a lease), before the output leaves P,
        so D's first read finds them. False (D will recompute) when the worker does not answer."""
        try:
            reply = request(self._ctx, f"tcp://{self._host}:{self._port}",
                            {"op": "hold", "req_id": req_id, "block_ids": list(block_ids),
                             "lease_s": self._lease_s}, self._timeout_s)
            return json.loads(reply[0])["status"] == "ok"
        except Exception as e:   # noqa: BLE001
            self._warn(f"ZmqPullConnector: cannot hold {req_id}'s blocks ({e}); D will recompute.")
            return False

    def _send_done(self, params: dict) -> None:
        try:
            request(self._ctx, f"tcp://{params['remote_host']}:{params['remote_port']}",
                    {"op": "done", "req_id": params.get("remote_request_id"),
                     "engine_id": params.get("remote_engine_id")}, 0.5)
        except Exception:   # noqa: BLE001 (P is gone: its lease frees the blocks)
            pass
