"""The worker half of ``ZmqPullConnector``: P serves reads of its held blocks on a ZeroMQ side
channel, D pulls them into its own blocks, layer by layer (vLLM:
vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_worker.py, where NIXL reads P's GPU memory
over RDMA; here a ROUTER socket on P answers read requests over TCP).

Messages (multipart; the first frame is a JSON header, a reply to ``read`` carries the rows):
- ``handshake`` -> P's engine_id, model fingerprint, dtype, block size, KV layout, layer count;
- ``hold`` (P's own scheduler half, before the request's output leaves P) registers
  ``block_ids`` of ``req_id`` with a lease deadline;
- ``read {engine_id, req_id, block_ids, layer}`` -> ``kv[layer][:, block_ids]`` as
  ``[2, n, block_size, num_kv_heads, head_dim]`` bytes, or ``refused`` with the reason (another
  engine, unknown / expired / freed request, blocks it does not hold);
- ``done {req_id}`` (D read everything, or gave up) -> P reports ``finished_sending`` next step.
A lease that passes without ``done`` frees the blocks too (logged with the request id). There is
no heartbeat: a slow reader's lease is not extended. With CURVE configured
(``zmq_pull_curve.py``) the channel is encrypted and P answers only the decode instances whose
public keys it allows.

Paged cache per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V). P's
held blocks are never written while held (the scheduler does not hand them out), and D writes only
into blocks of a request parked in ``WAITING_FOR_REMOTE_KVS``, so no lock guards the tensors.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch

from minivllm.distributed.kv_transfer.base import KVConnectorRole
from minivllm.distributed.kv_transfer.zmq_pull_curve import CurveSecurity, warn_if_open
from minivllm.distributed.kv_transfer.zmq_pull_metadata import RecvReqMeta
from minivllm.utils import keep_off_openmp

logger = logging.getLogger(__name__)
KV_LAYOUT = "[2, num_blocks, block_size, num_kv_heads, head_dim]"


class PullError(Exception):
    """A pull that cannot complete: P refused, timed out, or does not match D."""


class PullRefused(PullError):
    """P answered, and said no: D does not send ``done`` (the blocks may be someone else's)."""


def request(ctx: Any, address: str, header: dict, timeout_s: float) -> list[bytes]:
    """One REQ round trip with bounded waits (a dead peer costs ``timeout_s``, never a hang)."""
    import zmq
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(address)
        sock.send(json.dumps(header).encode())
        return sock.recv_multipart()
    except zmq.Again:
        raise PullError(f"{address} did not answer {header['op']!r} within {timeout_s:g} s") from None
    finally:
        sock.close()


class ZmqPullWorkerMixin:
    def _init_worker_state(self) -> None:
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        # P: req_id -> (block ids, lease deadline on time.monotonic()); finished reads to report.
        self._held: dict[str, tuple[list[int], float]] = {}
        self._gone: deque[str] = deque(maxlen=4096)    # freed or expired: refused, not unknown
        self._sent: set[str] = set()
        # D: pulls in flight, finished ones, their failed blocks, aborted ones.
        self._pulls: Optional[ThreadPoolExecutor] = None
        self._inflight: set[str] = set()
        self._num_in_flight = 0
        self._recving_done: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._cancelled: set[str] = set()
        self._pull_done = threading.Event()
        self._handshakes: dict[str, dict] = {}
        self._stop = False
        self._listener: Optional[threading.Thread] = None
        # CURVE (zmq_pull_curve.py): every socket of this instance's context is a CURVE client,
        # and P's ROUTER a CURVE server that answers only allowed keys.
        extra = self._kv_transfer_config.kv_connector_extra_config
        self._curve = CurveSecurity.from_extra_config(extra, self._is_producer, self._is_consumer)
        if self._curve is not None:
            self._ctx = self._curve.client_ctx
        if self._is_producer and self.role is KVConnectorRole.WORKER:
            import zmq
            self._server = (self._curve.server_socket() if self._curve is not None
                            else self._ctx.socket(zmq.ROUTER))
            if self._curve is None:
                warn_if_open(self._host)
            self._server.setsockopt(zmq.LINGER, 0)
            self._server.bind(f"tcp://{self._host}:{self._port}")
            self._listener = threading.Thread(target=self._serve, name="minivllm-kv-side-channel",
                                              daemon=True)
            self._listener.start()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._record("register_kv_caches", args={n: list(t.shape) for n, t in kv_caches.items()})

    def _handshake_info(self) -> dict:
        kv = next(iter(self._kv_caches.values()), None)
        return {"engine_id": self._engine_id, "fingerprint": self._fp,
                "block_size": self._block_size, "layout": self._layout, "kv_layout": KV_LAYOUT,
                "num_layers": len(self._kv_caches),
                "kv_shape": list(kv.shape[2:]) if kv is not None else None}

    # ------------------------------------------------------------------ P: the side channel
    def _serve(self) -> None:
        import zmq
        keep_off_openmp()   # its gathers must not give the engine's OpenMP regions a rival team
        poller = zmq.Poller()
        poller.register(self._server, zmq.POLLIN)
        while not self._stop:
            if not poller.poll(100):
                continue
            ident, _, raw = self._server.recv_multipart()
            try:
                reply = self._answer(json.loads(raw))
            except Exception as e:   # noqa: BLE001 (a bad message must not kill the channel)
                reply = [json.dumps({"status": "refused", "reason": f"bad message: {e}"}).encode()]
            self._server.send_multipart([ident, b"", *reply])

    def _answer(self, msg: dict) -> list[bytes]:
        op = msg["op"]
        ok = {"status": "ok"}
        if op == "handshake":
            return [json.dumps({**ok, **self._handshake_info()}).encode()]
        if op == "hold":
            with self._lock:
                self._held[msg["req_id"]] = (list(msg["block_ids"]),
                                             time.monotonic() + float(msg["lease_s"]))
            return [json.dumps(ok).encode()]
        if op == "done":
            if msg.get("engine_id") != self._engine_id:
                return [json.dumps({"status": "refused", "reason": "another engine"}).encode()]
            with self._lock:
                if self._held.pop(msg["req_id"], None) is not None:
                    self._sent.add(msg["req_id"])
                    self._gone.append(msg["req_id"])
            return [json.dumps(ok).encode()]
        if op != "read":
            raise ValueError(f"unknown op {op!r}")
        req_id = msg["req_id"]
        with self._lock:
            held = self._held.get(req_id)
            expired = held is not None and time.monotonic() > held[1]
        reason = None
        if msg.get("engine_id") != self._engine_id:
            reason = f"engine {msg.get('engine_id')!r} is not this engine ({self._engine_id!r})"
        elif held is None or expired:
            reason = (f"request {req_id!r} was already freed or its lease expired"
                      if req_id in self._gone or expired else f"request {req_id!r} is not held here")
        elif not set(msg["block_ids"]) <= set(held[0]):
            reason = f"blocks {sorted(set(msg['block_ids']) - set(held[0]))} are not {req_id!r}'s"
        if reason is not None:
            return [json.dumps({"status": "refused", "reason": reason}).encode()]
        kv = list(self._kv_caches.values())[int(msg["layer"])]
        rows = kv[:, torch.tensor(msg["block_ids"], dtype=torch.long, device=kv.device)]
        rows = rows.cpu().contiguous()
        header = {**ok, "shape": list(rows.shape), "dtype": str(rows.dtype).removeprefix("torch.")}
        return [json.dumps(header).encode(), rows.view(torch.uint8).numpy().tobytes()]

    def _expire_leases(self) -> set[str]:
        now, expired = time.monotonic(), set()
        with self._lock:
            for req_id, (block_ids, deadline) in list(self._held.items()):
                if now > deadline:
                    del self._held[req_id]
                    self._gone.append(req_id)
                    expired.add(req_id)
                    logger.warning("ZmqPullConnector: the lease of request %r expired after "
                                   "%g s without a finished read; freeing its %d blocks.",
                                   req_id, self._lease_s, len(block_ids))
        self._stats["num_leases_expired"] += len(expired)
        return expired

    # ------------------------------------------------------------------ D: pulls
    def _check_handshake(self, address: str) -> dict:
        info = self._handshakes.get(address)
        if info is None:
            reply = json.loads(request(self._ctx, address, {"op": "handshake"}, self._timeout_s)[0])
            mine = self._handshake_info()
            for key in ("fingerprint", "block_size", "layout", "kv_layout", "num_layers", "kv_shape"):
                if reply.get(key) != mine[key]:
                    raise PullError(
                        f"handshake with {address} refused: {key} differs (P {reply.get(key)!r}, "
                        f"D {mine[key]!r}); start P and D with the same model, dtype and block size")
            self._handshakes[address] = info = reply
        return info

    def _pull(self, req: RecvReqMeta) -> None:
        t0, nbytes, error = time.perf_counter(), 0, None
        address = f"tcp://{req.remote_host}:{req.remote_port}"
        try:
            self._check_handshake(address)
            for i, kv in enumerate(self._kv_caches.values()):
                if req.req_id in self._cancelled:
                    raise PullError("aborted on D")
                frames = request(self._ctx, address, {
                    "op": "read", "engine_id": req.remote_engine_id, "req_id": req.remote_request_id,
                    "block_ids": req.remote_block_ids, "layer": i}, self._timeout_s)
                header = json.loads(frames[0])
                if header["status"] != "ok":
                    raise PullRefused(f"P refused the read: {header['reason']}")
                want = [2, len(req.local_block_ids), *kv.shape[2:]]
                if header["shape"] != want or header["dtype"] != str(kv.dtype).removeprefix("torch."):
                    raise PullError(f"P sent {header['shape']} {header['dtype']}, expected {want}")
                rows = torch.frombuffer(bytearray(frames[1]), dtype=kv.dtype).view(want)
                kv[:, torch.tensor(req.local_block_ids, dtype=torch.long, device=kv.device)] = (
                    rows.to(kv.device))
                nbytes += len(frames[1])
        except Exception as e:   # noqa: BLE001 (every failure becomes invalid blocks, never a hang)
            error = e
        if not isinstance(error, PullRefused):
            try:   # tell P to free, whatever happened (best effort: P may be gone)
                request(self._ctx, address, {"op": "done", "req_id": req.remote_request_id,
                                             "engine_id": req.remote_engine_id},
                        min(self._timeout_s, 1.0))
            except Exception:   # noqa: BLE001
                pass
        with self._lock:
            if error is not None and req.req_id in self._cancelled:
                pass        # aborted: its blocks are freed, nothing to recompute
            elif error is not None:
                self._stats["num_load_errors"] += 1
                self._invalid_block_ids.update(req.local_block_ids)
            else:
                self._stats["num_loaded_tokens"] += req.num_tokens
                self._stats["num_loaded_bytes"] += nbytes
                self._stats["load_time_s"] += time.perf_counter() - t0
            self._recving_done.add(req.req_id)
            self._inflight.discard(req.req_id)
            self._num_in_flight -= 1
        self._pull_done.set()
        if error is not None and req.req_id not in self._cancelled:
            hint = (" (with CURVE, P does not answer a key it does not allow)"
                    if self._curve is not None and "did not answer" in str(error) else "")
            self._warn(f"ZmqPullConnector: pulling {req.req_id} from {address} failed ({error})"
                       f"{hint}; kv_load_failure_policy decides (recompute or error).")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """D: hand this step's pulls to the pull threads and return at once (async loads)."""
        md = self._connector_metadata
        if not self._kv_caches and forward_context is not None:
            self._kv_caches = {name: layer.kv_cache
                               for name, layer in forward_context.no_compile_layers.items()}
        self._no_forward = forward_context is None or forward_context.attn_metadata is None
        for req in (md.reqs_to_recv if md is not None else []):
            if self._pulls is None:
                # keep_off_openmp: their copies into the cache must not start OpenMP teams
                # beside the engine's (minivllm/utils.py keep_off_openmp)
                self._pulls = ThreadPoolExecutor(self._num_pull_threads,
                                                 thread_name_prefix="minivllm-kv-pull",
                                                 initializer=keep_off_openmp)
            with self._lock:
                self._num_in_flight += 1
                self._inflight.add(req.req_id)
            self._pulls.submit(self._pull, req)
        if md is not None and md.reqs_to_recv:
            self._record("start_load_kv", args={"async": [r.req_id for r in md.reqs_to_recv]})

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a pulled request runs only after ``finished_recving``."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """P saves nothing: D reads P's blocks where they are."""

    def wait_for_save(self) -> None:
        """Nothing is written anywhere on P."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """(finished_sending: read by D or lease expired, finished_recving: pulls done or given
        up). ``finished_req_ids`` that are still pulling are aborted on D: stop between layers."""
        with self._lock:
            self._cancelled.update(set(finished_req_ids) & self._inflight)
        if getattr(self, "_no_forward", False) and self._num_in_flight and not self._recving_done:
            self._pull_done.wait(0.01)
        expired = self._expire_leases() if self._is_producer else set()
        with self._lock:
            self._pull_done.clear()
            sent, self._sent = self._sent | expired, set()
            recvd, self._recving_done = self._recving_done, set()
            self._cancelled -= recvd
        if sent or recvd:
            self._record("get_finished", result={"finished_sending": sorted(sent),
                                                 "lease_expired": sorted(expired),
                                                 "finished_recving": sorted(recvd)})
        return sent or None, recvd or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            bad, self._invalid_block_ids = self._invalid_block_ids, set()
        return bad

    def shutdown(self) -> None:
        self._stop = True
        if self._listener is not None:
            self._listener.join(timeout=1.0)
            self._server.close()
            self._listener = None
        if self._pulls is not None:
            self._pulls.shutdown(wait=True)   # every pull is bounded by timeout_s per message
            self._pulls = None
        if self._curve is not None:
            self._curve.close()
            self._curve = None
