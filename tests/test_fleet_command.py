"""The fleet command as a process: ``python -m minivllm.disagg.fleet`` with its own Redis store
(``RedisStoreConnector`` without ``--kv-store-url``), killed outright (SIGKILL, as the OOM killer
does). Its ``redis-server`` must die with it: nothing else would ever stop it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

STARTUP_S = 240          # Ray, Serve and the store on a busy 2-core machine
GONE_S = 10              # Linux delivers the parent-death signal at once; a margin for the reaper


def _stat(pid: int) -> tuple[str, int, str] | None:
    """``(state, parent PID, start time)`` from ``/proc/PID/stat``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text.rsplit(")", 1)[1].split()      # after "(comm)": state, ppid, ..., starttime
    return fields[0], int(fields[1]), fields[19]


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _alive(pid: int, started: str) -> bool:
    """The same process (PID and start time) still runs: not gone, not a zombie."""
    st = _stat(pid)
    return st is not None and st[2] == started and st[0] != "Z"


def _descendants(root: int) -> dict[int, str]:
    """{PID: start time} of every process below ``root`` now."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            parents[int(name)] = (st[1], st[2])
    out, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, (ppid, started) in parents.items():
            if ppid == pid and child not in out:
                out[child] = started
                frontier.append(child)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's")
def test_a_sigkilled_fleet_command_leaves_no_redis_server_of_its_own(tmp_path, tiny_chat_dir):
    """SIGKILL the command once its store runs: its ``redis-server`` (found by its parent PID) is
    gone within a bounded wait. Whatever the command had started and is still there afterwards
    is killed by PID, so a failure leaves nothing behind either."""
    log_path = tmp_path / "fleet.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_path, "w") as log:
        cmd = subprocess.Popen(
            [sys.executable, "-m", "minivllm.disagg.fleet", "--kv-connector", "RedisStoreConnector",
             "--prefill", "1", "--decode", "1", "--model", tiny_chat_dir, "--port", "0",
             "--replica-num-cpus", "1", "--server-args=--max-model-len 1024"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    left: dict[int, str] = {}
    try:
        deadline = time.monotonic() + STARTUP_S
        store = None
        while store is None:
            assert cmd.poll() is None, f"the fleet command exited ({cmd.returncode}):\n" + \
                log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no redis-server under the fleet command:\n" + \
                log_path.read_text()[-3000:]
            store = next((pid for pid in _descendants(cmd.pid) if _comm(pid) == "redis-server"
                          and (_stat(pid) or ("", 0))[1] == cmd.pid), None)
            time.sleep(0.2)
        left = _descendants(cmd.pid)
        started = left[store]
        cmd.send_signal(signal.SIGKILL)
        cmd.wait(timeout=30)
        deadline = time.monotonic() + GONE_S
        while _alive(store, started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(store, started), f"redis-server {store} outlived the fleet command"
    finally:
        if cmd.poll() is None:
            cmd.kill()
            cmd.wait(timeout=30)
        for pid, started in left.items():      # by PID, and only the process that was there
            if _alive(pid, started):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
