"""The HTTP doors, as real processes on 127.0.0.1: a server with an API key (from
``VLLM_API_KEY``) serving HTTPS with a certificate from a throwaway CA, and the P/D proxy in
front of it with its own key (``--api-key``), its key for the instance (``--backend-api-key``)
and the CA (``--backend-ca``).

- a stranger (no key, a wrong key; streamed or not; the ``openai`` client or plain HTTP) gets
  401 with OpenAI's error JSON from the server and from the proxy, and reaches no engine;
  ``/health`` and ``/metrics`` stay open;
- the right key gives the offline engine's greedy output, directly and through the proxy (which
  sends the instance its own key: the client's is not the server's);
- ``/openapi.json`` carries the bearer scheme, and schemathesis with the key finds no 5xx and no
  undocumented status (``ignored_auth``: an operation that ignores a missing key is a failure);
- a plain-text client against the TLS server fails cleanly and the server lives on; a proxy
  without the CA cannot reach the instance;
- no key appears in any process's log.
"""
from __future__ import annotations

import logging
import os
import secrets
import ssl
import subprocess
import sys

import httpx
import openai
import pytest

from security_utils import assert_no_secrets, make_tls, metric, start
from server_utils import child_env, free_port, stop

import cryptography  # noqa: F401  (the test CA; a missing prerequisite fails, never skips)
import schemathesis  # noqa: F401

KEY = "sk-test-" + secrets.token_urlsafe(16)          # the server's
PROXY_KEY = "sk-proxy-" + secrets.token_urlsafe(16)   # the proxy's clients'
MAX_MODEL_LEN = 40
PROMPT = "The capital of France is"
CHECKS = "not_a_server_error,status_code_conformance,response_schema_conformance,ignored_auth"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("security_http")


@pytest.fixture(scope="module")
def tls(folder):
    paths = make_tls(str(folder))
    return {**paths, "verify": ssl.create_default_context(cafile=paths["ca"])}


@pytest.fixture(scope="module")
def server(tiny_chat_dir, tls, folder):
    port = free_port()
    url, log = f"https://127.0.0.1:{port}", str(folder / "server.log")
    proc = start(["minivllm.serve", "--model", tiny_chat_dir, "--served-model-name", "tiny",
                  "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1",
                  "--num-gpu-blocks-override", "64", "--seed", "0", "--port", str(port),
                  "--ssl-keyfile", tls["key"], "--ssl-certfile", tls["cert"]],
                 log, url, env={"VLLM_API_KEY": KEY}, verify=tls["verify"])
    yield {"url": url, "log": log, "port": port}
    stop_with_an_idle_connection(proc, url, tls["verify"])


def stop_with_an_idle_connection(proc, url: str, verify) -> None:
    """SIGTERM stops the server at once although a client keeps a TLS connection open (no
    request in flight): exit code 0, not the SIGKILL that ``stop`` sends after 15 s."""
    with httpx.Client(verify=verify) as idle:
        assert idle.get(url + "/health").status_code == 200
        stop(proc)
    assert proc.returncode == 0


def start_proxy(server, folder, name: str, extra: list[str]) -> tuple[str, subprocess.Popen]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(["minivllm.disagg.proxy", "--prefill", server["url"], "--decode", server["url"],
                  "--port", str(port), "--api-key", PROXY_KEY, *extra],
                 str(folder / f"{name}.log"), url, ready="/openapi.json", timeout=60)
    return url, proc


@pytest.fixture(scope="module")
def proxy(server, tls, folder):
    url, proc = start_proxy(server, folder, "proxy",
                            ["--backend-api-key", KEY, "--backend-ca", tls["ca"]])
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def reference(tiny_chat_dir) -> str:
    from minivllm import LLM, SamplingParams
    llm = LLM(model=tiny_chat_dir, max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64, seed=0)
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6,
                                                 ignore_eos=True))[0].outputs[0].text


def client(base: str, key: str, ca=True) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60,
                         http_client=httpx.Client(verify=ca))


def complete(c: openai.OpenAI, stream: bool) -> str:
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})
    if not stream:
        return c.completions.create(**kw).choices[0].text
    return "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True)
                   if ch.choices)


def test_every_door_refuses_a_stranger(server, proxy, tls):
    before = metric_tls(server, tls, "vllm:prompt_tokens_total")
    for base, ca in ((server["url"], tls["verify"]), (proxy, True)):
        for key in (None, "wrong-key", KEY if base == proxy else PROXY_KEY):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            for stream in (False, True):
                for path, body in (("/v1/completions", {"prompt": PROMPT}),
                                   ("/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": "Hi"}]})):
                    r = httpx.post(base + path, json={"model": "tiny", "max_tokens": 2,
                                                      "stream": stream, **body},
                                   headers=headers, verify=ca, timeout=30)
                    assert r.status_code == 401, (base, key, r.text)
                    err = r.json()["error"]
                    assert err["code"] == 401 and err["type"] == "AuthenticationError"
                    assert r.headers["www-authenticate"] == "Bearer"
            assert httpx.get(base + "/v1/models", headers=headers, verify=ca).status_code == 401
            for stream in (False, True):
                with pytest.raises(openai.AuthenticationError):
                    complete(client(base, key or "not-a-key", ca), stream)
    assert httpx.get(proxy + "/proxy/requests").status_code == 401
    # The open doors, and nothing reached the engine.
    assert httpx.get(server["url"] + "/health", verify=tls["verify"]).status_code == 200
    assert httpx.get(proxy + "/health").status_code == 200
    assert metric_tls(server, tls, "vllm:prompt_tokens_total") == before


def metric_tls(server, tls, name: str) -> float:
    return metric(server["url"], name, tls["verify"])


def test_the_key_serves_the_offline_output(server, proxy, tls, reference):
    for stream in (False, True):
        assert complete(client(server["url"], KEY, tls["verify"]), stream) == reference
        # The proxy's client key is not the server's: the proxy sent its own backend key.
        assert complete(client(proxy, PROXY_KEY), stream) == reference
    records = httpx.get(proxy + "/proxy/requests",
                        headers={"Authorization": f"Bearer {PROXY_KEY}"}).json()
    assert records and all(r["prefill_error"] is None for r in records)
    models = client(proxy, PROXY_KEY).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_openapi_documents_the_bearer_scheme(server, proxy, tls):
    for base, ca in ((server["url"], tls["verify"]), (proxy, True)):
        spec = httpx.get(base + "/openapi.json", verify=ca).json()
        assert spec["components"]["securitySchemes"]["bearerAuth"] == {
            "type": "http", "scheme": "bearer", "description": "the server's --api-key"}
        for path, ops in spec["paths"].items():
            for op in ops.values():
                guarded = path.startswith(("/v1", "/proxy"))
                assert ("security" in op) == guarded, path
                assert ("401" in op["responses"]) == guarded, path


def test_fuzzing_with_the_key(server, tls, tmp_path, reference):
    exe = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    cmd = [exe if os.path.exists(exe) else "schemathesis", "run", server["url"] + "/openapi.json",
           "--checks", CHECKS, "--seed", "0", "--max-examples", "3", "--continue-on-failure",
           "--workers", "1", "--request-timeout", "60", "--phases", "coverage,fuzzing",
           "--no-color", "--tls-verify", tls["ca"], "-H", f"Authorization: Bearer {KEY}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=str(tmp_path),
                       env=child_env(SCHEMATHESIS_HOOKS=""))
    report = (r.stdout + r.stderr).replace(KEY, "<KEY>")
    assert r.returncode == 0 and "No issues found" in report, report[-6000:]
    assert " generated, " in report, report[-3000:]
    assert complete(client(server["url"], KEY, tls["verify"]), False) == reference


def test_plain_text_against_tls_fails_cleanly(server, tls):
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{server['port']}/health", timeout=10)
    with pytest.raises(httpx.ConnectError):               # an unknown CA: refused by the client
        httpx.get(server["url"] + "/health", timeout=10)
    assert httpx.get(server["url"] + "/health", verify=tls["verify"]).status_code == 200


def test_proxy_without_the_ca_cannot_reach_the_instance(server, folder, tls):
    url, proc = start_proxy(server, folder, "proxy_no_ca", ["--backend-api-key", KEY])
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                      "max_tokens": 2},
                       headers={"Authorization": f"Bearer {PROXY_KEY}"}, timeout=30)
        assert r.status_code == 503
        assert "no decode instance answered" in r.json()["error"]["message"]
        rec = httpx.get(url + "/proxy/requests",
                        headers={"Authorization": f"Bearer {PROXY_KEY}"}).json()[-1]
        assert "CERTIFICATE_VERIFY_FAILED" in rec["prefill_error"]
    finally:
        stop(proc)


def test_no_key_in_any_log(server, folder):
    logs = [server["log"], str(folder / "proxy.log"), str(folder / "proxy_no_ca.log")]
    assert "API key required" in open(server["log"]).read()
    assert_no_secrets(logs, [KEY, PROXY_KEY])


def test_keys_from_flags_and_environment_and_the_open_host_warning(monkeypatch, caplog):
    from minivllm.entrypoints.openai.auth import api_keys_from, warn_if_open
    monkeypatch.setenv("MINIVLLM_API_KEY", "b")
    assert api_keys_from(None) == ["b"]
    monkeypatch.setenv("VLLM_API_KEY", "a")
    assert api_keys_from(None) == ["a"] and api_keys_from(["c", "d"]) == ["c", "d"]
    monkeypatch.setenv("VLLM_API_KEY", "")
    monkeypatch.setenv("MINIVLLM_API_KEY", "")
    assert api_keys_from(None) == []
    with caplog.at_level(logging.WARNING):
        for host, keys in (("127.0.0.2", []), ("localhost", []), ("::1", []), ("0.0.0.0", ["k"])):
            warn_if_open(host, keys)
        assert caplog.records == []
        warn_if_open("0.0.0.0", [])
        warn_if_open("10.1.2.3", [], "the P/D proxy")
    assert len(caplog.records) == 2 and all("--api-key" in r.getMessage() and "\n" not in
                                            r.getMessage() for r in caplog.records)
    assert "the P/D proxy binds 10.1.2.3" in caplog.records[1].getMessage()
