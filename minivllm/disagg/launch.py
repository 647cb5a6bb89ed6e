"""``python -m minivllm.disagg.launch --prefill N --decode M --port P [--model M] [--seed S]``: a
whole P/D cluster on one machine, on 127.0.0.1, as vLLM's XpYd example script starts one
(``examples/online_serving/disaggregated_serving_p2p_nccl_xpyd/disagg_example_p2p_nccl_xpyd.sh``:
the instances, then the proxy): the KV store (a Redis server from ``python -m minivllm.kvstore``
for ``RedisStoreConnector``, a temporary folder for ``SharedStorageConnector``, nothing for
``ZmqPullConnector``: each decode server pulls from the prefill server's side channel named in the
``kv_transfer_params``), N prefill servers (``kv_producer``), M decode servers (``kv_consumer``),
each a ``python -m minivllm.serve`` process with its share of the CPU threads, and the proxy on
port P. It prints the URLs (and one JSON line with every PID), waits until every
instance answers ``/health``, and stops every child it started, by PID, on exit or Ctrl-C.

``start_cluster()`` / ``Cluster.stop()`` are the same thing as a Python API.

Guards (see ``minivllm/entrypoints/openai/auth.py``,
``minivllm/distributed/kv_transfer/redis_server.py``,
``minivllm/distributed/kv_transfer/zmq_pull_curve.py``):
- ``--api-key KEY`` (``auto``: a random one, printed once): every server and the proxy require it;
  children get it in their environment (``VLLM_API_KEY``), never on a command line;
- ``--secure``: ``--api-key auto`` unless a key is given, plus, in a private temporary folder
  removed at exit, a password for the Redis store (``--password-file``; the instances read the
  file) or CURVE keypairs for ``ZmqPullConnector`` (``python -m minivllm.disagg.keys``; P allows
  exactly the cluster's decode instances). ``SharedStorageConnector``'s folder is private to the
  user (mode 0700) and has no other guard;
- ``--prefill-host`` / ``--decode-host``: the addresses the instances bind (and P's side channel),
  e.g. 127.0.0.1 and 127.0.0.2 to rehearse two hosts on one machine;
- ``--ssl-keyfile``, ``--ssl-certfile``, ``--backend-ca``: HTTPS for every server and the proxy
  (one certificate for all; the proxy checks the instances' against the CA). The certificate is
  the user's: ``--secure`` makes none.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import ssl as _ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CONNECTORS = ("RedisStoreConnector", "SharedStorageConnector", "ExampleConnector", "ZmqPullConnector")


def free_port(host: str = "127.0.0.1", taken: Optional[set[int]] = None) -> int:
    """A port nothing is bound to now. The probe socket closes before a child binds the port, so
    the OS may hand the same port out again: ``taken`` holds the ports this launch has already
    promised to a child (a server's HTTP port, a prefill's side channel), and gets this one."""
    while True:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if taken is None or port not in taken:
            if taken is not None:
                taken.add(port)
            return port


def redis_available() -> bool:
    """True when this package has the Redis-backed connector and the store's launcher."""
    import importlib.util
    from minivllm.distributed.kv_transfer.factory import KVConnectorFactory
    return ("RedisStoreConnector" in KVConnectorFactory._registry
            and importlib.util.find_spec("minivllm.kvstore") is not None)


@dataclass
class Cluster:
    proxy_url: str
    prefill_urls: list[str]
    decode_urls: list[str]
    kv_connector: str
    kv_store: str                                   # the Redis URL or the shared folder
    log_dir: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)   # name -> child
    api_key: Optional[str] = field(default=None, repr=False)        # never in describe()
    secrets_dir: Optional[str] = None                               # --secure: keys, password
    _owned_dirs: list[str] = field(default_factory=list)

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def describe(self) -> dict:
        return {"proxy": self.proxy_url, "prefill": self.prefill_urls, "decode": self.decode_urls,
                "kv_connector": self.kv_connector, "kv_store": self.kv_store,
                "log_dir": self.log_dir, "pids": self.pids(), "secrets_dir": self.secrets_dir,
                "api_key_required": self.api_key is not None}

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every child by PID (the proxy first, the store last), then SIGKILL stragglers."""
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for d in self._owned_dirs:
            shutil.rmtree(d, ignore_errors=True)

    def _spawn(self, name: str, args: list[str], env: dict) -> subprocess.Popen:
        """``python -m ARGS`` as the child ``name``, its output in ``log_dir/name.log``."""
        log = open(os.path.join(self.log_dir, f"{name}.log"), "w")
        p = subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)   # Ctrl-C reaches us, not them
        self.procs[name] = p
        return p

    def _start_redis(self, env: dict, password_file: Optional[str] = None,
                     port: Optional[int] = None) -> str:
        """``python -m minivllm.kvstore`` as the child ``kvstore``; returns the URL it prints."""
        guard = (["--password-file", password_file, "--print-url-without-password"]
                 if password_file else [])
        p = subprocess.Popen([sys.executable, "-m", "minivllm.kvstore",
                              "--port", str(port or free_port()), *guard],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                             start_new_session=True)
        self.procs["kvstore"] = p
        line = p.stdout.readline().strip()       # the command prints its URL as its first line
        if not line.startswith(("redis://", "unix://")):
            raise RuntimeError("python -m minivllm.kvstore did not print its URL: "
                               f"{line.split('@')[-1]!r}")   # (no credentials in the message)
        return line

    def _secure_files(self, kv_connector: str, num_decode: int) -> dict:
        """--secure: the cluster's secrets in a private folder; returns each role's extra
        config."""
        import secrets as _secrets
        d = self.secrets_dir = tempfile.mkdtemp(prefix="minivllm-secrets-")
        self._owned_dirs.append(d)
        out: dict = {}
        if kv_connector == "RedisStoreConnector":
            path = os.path.join(d, "kvstore.pass")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(_secrets.token_urlsafe(24) + "\n")
            out["password_file"] = path
        elif kv_connector == "ZmqPullConnector":
            from minivllm.disagg.keys import make_keys
            out["curve"] = make_keys(os.path.join(d, "curve"), num_decode)
        return out


def wait_healthy(cluster: Cluster, urls: list[str], timeout: float, verify=True) -> None:
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending:
        for name, p in cluster.procs.items():
            if p.poll() is not None:
                log = os.path.join(cluster.log_dir, f"{name}.log")
                tail = open(log).read()[-2000:] if os.path.exists(log) else ""
                raise RuntimeError(f"{name} (pid {p.pid}) exited with {p.returncode}:\n{tail}")
        for url in list(pending):
            try:
                if httpx.get(url + "/health", timeout=2.0, verify=verify).status_code == 200:
                    pending.remove(url)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not healthy after {timeout:.0f} s: {pending}")
        if pending:
            time.sleep(0.5)


def start_cluster(num_prefill: int = 1, num_decode: int = 1, port: Optional[int] = None,
                  model: str = DEFAULT_MODEL, seed: int = 0, num_threads: Optional[int] = None,
                  kv_connector: str = "auto", server_args: Optional[list[str]] = None,
                  log_dir: Optional[str] = None, startup_timeout: float = 300.0,
                  api_key: Optional[str] = None, secure: bool = False,
                  prefill_host: str = "127.0.0.1", decode_host: str = "127.0.0.1",
                  proxy_host: str = "127.0.0.1", kv_extra_config: Optional[dict] = None,
                  ssl: Optional[tuple[str, str, str]] = None) -> Cluster:
    """``api_key``: a key, or ``"auto"`` (a random one; ``Cluster.api_key``). ``secure``: see the
    module docstring. ``kv_extra_config``: merged into every instance's extra config. ``ssl``:
    ``(keyfile, certfile, ca_file)``: every server and the proxy serve HTTPS with that certificate
    (valid for every host used), and the proxy checks the instances' against the CA."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"--prefill and --decode must be >= 1, got {num_prefill}, {num_decode}.")
    if kv_connector == "auto":
        kv_connector = "RedisStoreConnector" if redis_available() else "SharedStorageConnector"
    if kv_connector not in CONNECTORS:
        raise ValueError(f"kv_connector must be 'auto' or one of {CONNECTORS}, got {kv_connector!r}.")
    total = num_threads or os.cpu_count() or 1
    per_instance = max(1, total // (num_prefill + num_decode))
    env = dict(os.environ, OMP_NUM_THREADS=str(per_instance))
    if api_key == "auto" or (secure and api_key is None):
        from minivllm.entrypoints.openai.auth import generate_api_key
        api_key = generate_api_key()
    if api_key:
        env["VLLM_API_KEY"] = api_key       # the servers' and the proxy's (auth.api_keys_from)
    owned = []
    if log_dir is None:
        log_dir = tempfile.mkdtemp(prefix="minivllm-cluster-logs-")
    scheme = "https" if ssl else "http"
    tls_args = ["--ssl-keyfile", ssl[0], "--ssl-certfile", ssl[1]] if ssl else []
    taken = {port} if port else set()       # no two children of this launch get the same port
    proxy_port = port or free_port(proxy_host, taken)
    cluster = Cluster(f"{scheme}://{_netloc(proxy_host, proxy_port)}", [], [],
                      kv_connector, "", log_dir, _owned_dirs=owned, api_key=api_key or None)
    try:
        guard = cluster._secure_files(kv_connector, num_decode) if secure else {}
        if kv_connector == "RedisStoreConnector":
            # not the proxy's port, chosen above but bound only once the servers are up
            cluster.kv_store = cluster._start_redis(env, guard.get("password_file"),
                                                    free_port(taken=taken))
            extra = {"url": cluster.kv_store}
            if "password_file" in guard:
                extra["password_file"] = guard["password_file"]
        elif kv_connector == "ZmqPullConnector":
            cluster.kv_store = "none (D pulls from P's side channel)"
            extra = {}
        else:
            cluster.kv_store = tempfile.mkdtemp(prefix="minivllm-kv-")
            owned.append(cluster.kv_store)
            extra = {"shared_storage_path": cluster.kv_store}
        extra.update(kv_extra_config or {})
        common = ["minivllm.serve", "--model", model, "--seed", str(seed),
                  "--num-threads", str(per_instance), *tls_args, *(server_args or [])]
        for role, n, urls in (("prefill", num_prefill, cluster.prefill_urls),
                              ("decode", num_decode, cluster.decode_urls)):
            for i in range(n):
                kv = {"kv_connector": kv_connector,
                      "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                      "kv_connector_extra_config": dict(extra)}
                host = prefill_host if role == "prefill" else decode_host
                if kv_connector == "ZmqPullConnector" and role == "prefill":
                    kv["kv_connector_extra_config"].update(side_channel_host=host,
                                                           side_channel_port=free_port(host, taken))
                if "curve" in guard:
                    kv["kv_connector_extra_config"].update(
                        guard["curve"]["prefill" if role == "prefill" else f"decode{i}"])
                p = free_port(host, taken)
                urls.append(f"{scheme}://{_netloc(host, p)}")
                cluster._spawn(f"{role}{i}", [*common, "--host", host, "--port", str(p),
                                              "--kv-transfer-config", json.dumps(kv)], env)
        cluster._spawn("proxy", ["minivllm.disagg.proxy", "--host", proxy_host,
                                 "--port", str(proxy_port), *tls_args,
                                 *(["--backend-ca", ssl[2]] if ssl else []),
                                 "--prefill", *cluster.prefill_urls,
                                 "--decode", *cluster.decode_urls], env)
        verify = _ssl.create_default_context(cafile=ssl[2]) if ssl else True
        wait_healthy(cluster, cluster.prefill_urls + cluster.decode_urls + [cluster.proxy_url],
                     startup_timeout, verify)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minivllm.disagg.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=int, default=1, help="number of prefill instances")
    ap.add_argument("--decode", type=int, default=1, help="number of decode instances")
    ap.add_argument("--port", type=int, default=8000, help="the proxy's port")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-threads", type=int, default=None,
                    help="CPU threads for all instances together (default: all cores)")
    ap.add_argument("--kv-connector", default="auto",
                    choices=["auto", *CONNECTORS])
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--server-args", default="",
                    help="extra flags for every server, e.g. \"--max-model-len 2048\"")
    ap.add_argument("--api-key", default=None,
                    help="every server and the proxy require it ('auto': a random key, printed "
                         "once)")
    ap.add_argument("--secure", action="store_true",
                    help="--api-key auto (unless given), a Redis password or CURVE keys, in a "
                         "private temporary folder")
    ap.add_argument("--host", default="127.0.0.1", help="the address the proxy binds")
    ap.add_argument("--prefill-host", default="127.0.0.1",
                    help="the address the prefill instances (and P's side channel) bind")
    ap.add_argument("--decode-host", default="127.0.0.1",
                    help="the address the decode instances bind")
    ap.add_argument("--ssl-keyfile", default=None, help="TLS: every server's and the proxy's key")
    ap.add_argument("--ssl-certfile", default=None,
                    help="TLS: their certificate (valid for every host address used)")
    ap.add_argument("--backend-ca", default=None,
                    help="TLS: the CA that signed it, which the proxy (and the launcher) check")
    ap.add_argument("--kv-extra-config", type=json.loads, default=None,
                    help="JSON merged into every instance's kv_connector_extra_config, e.g. "
                         "'{\"kv_lease_duration\": 10}'")
    args = ap.parse_args(argv)
    tls_files = (args.ssl_keyfile, args.ssl_certfile, args.backend_ca)
    if any(tls_files) and not all(tls_files):
        ap.error("TLS needs --ssl-keyfile, --ssl-certfile and --backend-ca")
    stop = {"now": False}

    def on_signal(signum, _frame):
        stop["now"] = True
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_signal)
    cluster = None
    try:
        cluster = start_cluster(args.prefill, args.decode, args.port, args.model, args.seed,
                                args.num_threads, args.kv_connector, args.server_args.split(),
                                startup_timeout=args.startup_timeout, api_key=args.api_key,
                                secure=args.secure, prefill_host=args.prefill_host,
                                decode_host=args.decode_host, proxy_host=args.host,
                                kv_extra_config=args.kv_extra_config,
                                ssl=tls_files if all(tls_files) else None)
        print(f"KV store ({cluster.kv_connector}): {cluster.kv_store}")
        for u in cluster.prefill_urls:
            print(f"prefill: {u}")
        for u in cluster.decode_urls:
            print(f"decode:  {u}")
        print(f"proxy:   {cluster.proxy_url}   (logs in {cluster.log_dir})")
        if cluster.api_key and cluster.api_key != args.api_key:     # generated: shown this once
            print(f"API key: {cluster.api_key}")
        if cluster.secrets_dir:
            print(f"secrets: {cluster.secrets_dir} (removed at exit)")
        print("CLUSTER " + json.dumps(cluster.describe()), flush=True)
        while not stop["now"]:
            for name, p in cluster.procs.items():
                if p.poll() is not None and name in ("proxy", "kvstore"):
                    print(f"{name} exited ({p.returncode}); stopping the cluster", flush=True)
                    stop["now"] = True
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        if cluster is not None:
            cluster.stop()
            print("stopped every child", flush=True)


if __name__ == "__main__":
    main()
