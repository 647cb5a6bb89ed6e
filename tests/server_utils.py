"""Helpers for tests that start real servers: a child process on 127.0.0.1 with a free port, the
package importable (PYTHONPATH points at this checkout, so tests work installed or not), stopped
by PID."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict:
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=REPO + (os.pathsep + path if path else ""), **extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{open(log_path).read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout} s:\n{open(log_path).read()[-3000:]}")


def start_server(args: list[str], log_path: str, timeout: float = 180.0,
                 port: int | None = None):
    """``python -m minivllm.serve ARGS --port <port or a free one>``; returns (url, Popen)."""
    port = port or free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "minivllm.serve", *args, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=child_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout, log_path)
    except BaseException:
        stop(proc)
        raise
    return url, proc


def start_proxy(prefill: list[str], decode: list[str], log_path: str, timeout: float = 60.0):
    """``python -m minivllm.disagg.proxy`` on a free port; returns (url, Popen). Ready when it
    serves its spec (its /health needs every instance up, and a test may give it a dead one)."""
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "minivllm.disagg.proxy", "--prefill", *prefill,
                             "--decode", *decode, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=child_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"proxy exited ({proc.returncode}):\n{open(log_path).read()}")
            try:
                if httpx.get(url + "/openapi.json", timeout=2).status_code == 200:
                    return url, proc
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"proxy not up after {timeout} s:\n{open(log_path).read()}")
            time.sleep(0.3)
    except BaseException:
        stop(proc)
        raise


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


SAMPLING_ARGS = ["--max-model-len", "256", "--num-gpu-blocks-override", "64", "--num-threads", "1",
                 "--seed", "0"]


def sampling_fixtures(log_name: str, extra_args: list[str]):
    """The sampling tests' module fixtures, to unpack at a test module's top level:
    ``server`` (a ``minivllm serve`` of the tiny chat model named "smol", with ``SAMPLING_ARGS``
    and ``extra_args``), ``client`` (the ``openai`` client on it) and ``llm`` (the offline ``LLM``
    it is compared with: the same model, no extra arguments)."""
    import pytest

    @pytest.fixture(scope="module", name="sampling_pair")
    def pair(tiny_chat_dir, tmp_path_factory):
        from minivllm import LLM
        log = str(tmp_path_factory.mktemp(log_name) / "server.log")
        url, proc = start_server(["--model", tiny_chat_dir, "--served-model-name", "smol",
                                  *SAMPLING_ARGS, *extra_args], log)
        yield url, LLM(model=tiny_chat_dir, max_model_len=256, num_gpu_blocks_override=64, seed=0)
        stop(proc)

    @pytest.fixture(scope="module", name="server")
    def server(sampling_pair):
        return sampling_pair[0]

    @pytest.fixture(scope="module", name="client")
    def client(server):
        import openai
        return openai.OpenAI(base_url=server + "/v1", api_key="EMPTY", max_retries=0, timeout=120)

    @pytest.fixture(scope="module", name="llm")
    def llm(sampling_pair):
        return sampling_pair[1]

    return pair, server, client, llm


def make_tiny_chat_model(path, smollm2_dir: str) -> str:
    """A tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer and chat template, so
    that servers start and step in moments while text, chat templates and stop strings are real."""
    import shutil
    from conftest import make_tiny_llama
    make_tiny_llama(path, vocab_size=49152, max_position_embeddings=1024,
                    bos_token_id=1, eos_token_id=2)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        if os.path.exists(os.path.join(smollm2_dir, name)):
            shutil.copy(os.path.join(smollm2_dir, name), os.path.join(str(path), name))
    return str(path)


def metric(url: str, name: str) -> float:
    """One sample of ``GET /metrics`` (Prometheus text), by its full name."""
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m is not None, f"{name} missing from /metrics"
    return float(m.group(1))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextmanager
def launch_cluster(model_dir: str, log_path: str, kv_connector: str, server_args: str,
                   num_prefill: int = 1, num_decode: int = 2, timeout: float = 240.0,
                   num_threads: int = 3, extra_args: tuple[str, ...] = ()):
    """``python -m minivllm.disagg.launch`` (on 127.0.0.1 unless ``extra_args`` say otherwise),
    yielding its ``CLUSTER`` line (proxy and instance URLs, pids) plus ``launcher`` and ``log``.
    On exit the launcher gets SIGTERM, and any child it left behind is killed by pid."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "minivllm.disagg.launch", "--prefill", str(num_prefill),
         "--decode", str(num_decode), "--port", str(free_port()), "--model", model_dir,
         "--num-threads", str(num_threads), "--kv-connector", kv_connector,
         "--server-args", server_args, *extra_args],
        stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=child_env())
    info, deadline = None, time.monotonic() + timeout
    while info is None and time.monotonic() < deadline and proc.poll() is None:
        for line in open(log_path):
            if line.startswith("CLUSTER "):
                info = json.loads(line[len("CLUSTER "):])
        time.sleep(0.5)
    try:
        assert info is not None, open(log_path).read()[-3000:]
        yield {**info, "launcher": proc, "log": log_path}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for pid in (info or {}).get("pids", {}).values():   # never leave a child behind
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


# The mixed workload of the launched-cluster tests: prompts longer than one KV block, so P's KV
# moves to D.
NUM_CLUSTER_REQUESTS = 8
CLUSTER_PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog, then the dog sleeps "
                   f"under the old oak tree while the fox counts to {i * 7} and back again."
                   for i in range(NUM_CLUSTER_REQUESTS)]
CLUSTER_SERVER_ARGS = "--max-model-len 512 --num-gpu-blocks-override 128"


def complete_in_turn(client, model: str, prompts: list[str], i: int, max_tokens: int = 8) -> str:
    """Request ``i`` of a mixed workload through the ``openai`` client: greedy, every token
    produced (``ignore_eos``), even requests whole, odd ones streamed."""
    kw = dict(model=model, prompt=prompts[i], max_tokens=max_tokens, temperature=0,
              extra_body={"ignore_eos": True})
    if i % 2 == 0:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                   if c.choices)
