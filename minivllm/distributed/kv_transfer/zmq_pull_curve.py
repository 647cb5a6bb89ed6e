"""CURVE on ``ZmqPullConnector``'s side channel: P serves its KV blocks only to the decode
instances whose public keys it knows. ZeroMQ's own answer (CurveZMQ, with ZAP through
``zmq.auth``), the way vLLM's ZMQ channels would be secured; NIXL itself has no such layer.

``kv_connector_extra_config`` keys (keypairs from ``python -m minivllm.disagg.keys DIR``, which
calls ``zmq.auth.create_certificates``):

- ``curve_secret_key_file``: this instance's ``NAME.key_secret`` (it holds both halves);
- ``curve_public_key_file``: optional, its ``NAME.key``; checked to match the secret file;
- ``curve_allowed_clients_dir`` (P): a folder of the allowed clients' ``*.key`` files. P's own key
  is always allowed (P's scheduler half registers its holds on the same channel). The folder is
  read again at most once a second, so adding or removing a decode instance's key needs no
  restart of P (every side-channel message opens a connection, checked anew);
- ``curve_server_public_key_file`` (D): P's ``NAME.key``. Every prefill instance a D pulls from
  must share that one server keypair (the cluster's "side channel certificate").

A peer that is not allowed gets no answer at all: the CURVE handshake fails, P logs the refusal
(the key, once a minute per key), D's request times out and goes by ``kv_load_failure_policy``,
and P's held blocks are freed when their lease expires, as for a D that never reads. The traffic
of an allowed peer is encrypted and authenticated; the handshake's own checks (model fingerprint,
block size, layout) then run as without CURVE. Secret keys never reach a log line.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Optional

logger = logging.getLogger(__name__)
CURVE_KEYS = ("curve_secret_key_file", "curve_public_key_file", "curve_allowed_clients_dir",
              "curve_server_public_key_file")


def _load(path: str, what: str) -> tuple[bytes, Optional[bytes]]:
    import zmq.auth
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"ZmqPullConnector: cannot read the CURVE {what} {path!r} "
                         f"({type(e).__name__}); make keys with `python -m minivllm.disagg.keys "
                         f"DIR`.") from None
    return public, secret


def validate_curve_config(extra: dict[str, Any], is_producer: bool, is_consumer: bool) -> None:
    """Before any weights load: the files exist and the roles have what they need."""
    if not any(extra.get(k) for k in CURVE_KEYS):
        return
    name = "kv_transfer_config.kv_connector_extra_config"
    if not extra.get("curve_secret_key_file"):
        raise ValueError(f"{name}: CURVE needs 'curve_secret_key_file' (this instance's "
                         f"NAME.key_secret).")
    public, secret = _load(extra["curve_secret_key_file"], "secret key file")
    if secret is None:
        raise ValueError(f"{name}['curve_secret_key_file'] holds no secret key (a NAME.key file?).")
    if extra.get("curve_public_key_file"):
        if _load(extra["curve_public_key_file"], "public key file")[0] != public:
            raise ValueError(f"{name}: 'curve_public_key_file' is not the public half of "
                             f"'curve_secret_key_file'.")
    if is_producer:
        d = extra.get("curve_allowed_clients_dir")
        if not d or not os.path.isdir(d):
            raise ValueError(f"{name}: a CURVE producer needs 'curve_allowed_clients_dir', a "
                             f"folder of the decode instances' public keys, got {d!r}.")
    if is_consumer:
        if not extra.get("curve_server_public_key_file"):
            raise ValueError(f"{name}: a CURVE consumer needs 'curve_server_public_key_file' "
                             f"(the prefill instances' NAME.key).")
        _load(extra["curve_server_public_key_file"], "server public key file")


def warn_if_open(host: str) -> None:
    """A warning, not a refusal: a side channel beyond loopback without CURVE serves P's blocks
    to anyone who can reach it and knows a request id."""
    import ipaddress
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        logger.warning("ZmqPullConnector: the side channel binds %s without CURVE: anyone who "
                       "can reach it may read held KV blocks; set curve_secret_key_file and "
                       "curve_allowed_clients_dir (python -m minivllm.disagg.keys).", host)


class _AllowedKeys:
    """ZAP credentials provider (``zmq.auth``'s callback): the allowed folder's keys and P's own."""

    def __init__(self, folder: str, own_public: bytes) -> None:
        self.folder, self.own = folder, own_public
        self._keys: set[bytes] = set()
        self._read_at = 0.0
        self._logged: dict[bytes, float] = {}
        self._lock = threading.Lock()
        self._reload()

    def _reload(self) -> None:
        import zmq.auth
        self._keys = set(zmq.auth.load_certificates(self.folder)) | {self.own}
        self._read_at = time.monotonic()

    def callback(self, domain: str, key: bytes) -> bool:
        with self._lock:
            if time.monotonic() - self._read_at > 1.0:     # keys added or removed
                self._reload()
            if key in self._keys:
                return True
            now = time.monotonic()
            if now - self._logged.get(key, -1e9) > 60.0:
                self._logged[key] = now
                logger.warning("ZmqPullConnector: refused a side-channel peer: its CURVE public "
                               "key %s is not in %s.", key.decode(), self.folder)
            return False


class CurveSecurity:
    """One instance's CURVE setup: a client context whose every socket is a CURVE client (the
    ``request`` round trips, both halves), and on P a CURVE server socket with ZAP."""

    def __init__(self, extra: dict[str, Any], is_producer: bool, is_consumer: bool) -> None:
        import zmq
        self.public, self.secret = _load(extra["curve_secret_key_file"], "secret key file")
        server_file = extra.get("curve_server_public_key_file")
        # P's scheduler half talks to its own worker's channel: the server key is its own.
        server = _load(server_file, "server public key file")[0] if server_file else self.public
        self.allowed_dir = extra.get("curve_allowed_clients_dir") if is_producer else None
        self.client_ctx = zmq.Context()
        self.client_ctx.setsockopt(zmq.CURVE_SERVERKEY, server)
        self.client_ctx.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        self.client_ctx.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        self._server_ctx: Any = None
        self._auth: Any = None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any], is_producer: bool,
                          is_consumer: bool) -> Optional["CurveSecurity"]:
        return cls(extra, is_producer, is_consumer) if extra.get("curve_secret_key_file") else None

    def server_socket(self) -> Any:
        """P's ROUTER, a CURVE server whose ZAP handler asks ``_AllowedKeys``."""
        import zmq
        from zmq.auth.thread import ThreadAuthenticator
        self._server_ctx = zmq.Context()
        self._auth = ThreadAuthenticator(self._server_ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", _AllowedKeys(self.allowed_dir, self.public))
        sock = self._server_ctx.socket(zmq.ROUTER)
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        return sock

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        for ctx in (self._server_ctx, self.client_ctx):
            if ctx is not None:
                ctx.destroy(linger=0)
