"""The server and the P/D proxy under fuzzing: ``schemathesis`` runs against their own
/openapi.json (fixed seed, a bounded number of cases per operation) with the checks
``not_a_server_error`` (no 5xx), ``status_code_conformance`` (every status is documented) and
``response_schema_conformance`` (every JSON answer, error or not, matches its documented schema).
Afterwards the server must still answer a normal request with the offline engine's output, and
malformed bodies sent to the proxy must be 400s from the proxy that reach no instance.

The server is a tiny random Llama with SmolLM2's tokenizer and chat template and a small
``max_model_len``, so that the requests the fuzzer gets right generate a few tokens at most.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from server_utils import child_env, free_port, metric, start_proxy, start_server, stop

pytest.importorskip("schemathesis")

MAX_MODEL_LEN = 40            # the chat template alone is ~30 tokens: chats generate <= 10
CHECKS = "not_a_server_error,status_code_conformance,response_schema_conformance"
MALFORMED = [                 # (body, the field error.param must name)
    ({"messages": [{}], "max_tokens": 4}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"prompt": "Hi", "temperature": -1}, "temperature"),
    ({"prompt": 3}, "prompt"),
]


@pytest.fixture(scope="module")
def server(tiny_chat_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("fuzz") / "server.log")
    url, proc = start_server(["--model", tiny_chat_dir, "--served-model-name", "tiny",
                              "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1",
                              "--num-gpu-blocks-override", "64", "--seed", "0"], log)
    yield url, log
    stop(proc)


def run_schemathesis(url: str, max_examples: int, tmp_path, timeout: float = 240) -> str:
    """The ``schemathesis run`` CLI against URL's spec; returns its report (asserts it passed)."""
    exe = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    cmd = [exe if os.path.exists(exe) else "schemathesis", "run", url + "/openapi.json",
           "--checks", CHECKS, "--seed", "0", "--max-examples", str(max_examples),
           "--continue-on-failure", "--workers", "1", "--request-timeout", "60",
           "--phases", "coverage,fuzzing", "--no-color"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path),
                          env=child_env(SCHEMATHESIS_HOOKS=""))
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-6000:]
    assert " generated, " in report and "No issues found" in report, report[-3000:]
    return report


def test_server_under_fuzzing_then_still_serves(server, tiny_chat_dir, tmp_path):
    url, log = server
    t0 = time.monotonic()
    report = run_schemathesis(url, max_examples=6, tmp_path=tmp_path)
    summary = next(line for line in report.splitlines() if " generated, " in line)
    print(f"schemathesis: {summary.strip()} in {time.monotonic() - t0:.0f} s")
    assert "Traceback" not in open(log).read()
    # The server still serves, and greedily gives what the offline engine gives.
    from minivllm import LLM, SamplingParams
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    llm = LLM(model=tiny_chat_dir, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64,
              seed=0)
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert r.json()["choices"][0]["text"] == out.outputs[0].text


def test_proxy_under_fuzzing_malformed_is_400_from_the_proxy(server, tmp_path):
    url, _ = server
    proxy, proc = start_proxy([url], [url], str(tmp_path / "proxy.log"))
    try:
        run_schemathesis(proxy, max_examples=3, tmp_path=tmp_path)
        records = len(httpx.get(proxy + "/proxy/requests").json())
        before = metric(url, "vllm:prompt_tokens_total")
        for body, param in MALFORMED:
            r = httpx.post(proxy + "/v1/chat/completions" if "messages" in body
                           else proxy + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "X-Prefill-Instance" not in r.headers        # answered by the proxy itself
        assert len(httpx.get(proxy + "/proxy/requests").json()) == records
        assert metric(url, "vllm:prompt_tokens_total") == before
    finally:
        stop(proc)


def test_proxy_passes_a_decode_400_unchanged(server, tmp_path):
    """With the prefill instance unreachable the request goes straight to decode; the decode
    instance's 400 (a prompt too long for the model: only it can tell) reaches the client as is."""
    url, _ = server
    dead = f"http://127.0.0.1:{free_port()}"
    proxy, proc = start_proxy([dead], [url], str(tmp_path / "proxy.log"))
    try:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": MAX_MODEL_LEN}
        direct = httpx.post(url + "/v1/completions", json=body, timeout=30)
        via = httpx.post(proxy + "/v1/completions", json=body, timeout=30)
        assert direct.status_code == via.status_code == 400
        assert via.content == direct.content and json.loads(via.content)["error"]["param"] == \
            "max_tokens"
        assert via.headers["X-Decode-Instance"] == url
        assert via.headers["X-Prefill-Status"] == "failed"
    finally:
        stop(proc)
