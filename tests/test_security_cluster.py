"""A secured P/D cluster on "two hosts" of one machine: ``python -m minivllm.disagg.launch
--secure --kv-connector ZmqPullConnector`` with P (and its side channel) on 127.0.0.1 and D on
127.0.0.2 (Linux routes all of 127/8 to loopback), so no code may assume one address. The
launcher makes an API key (printed once) and CURVE keypairs; P serves its KV only to D's key;
every server and the proxy serve HTTPS with a certificate from a throwaway CA.

- 8 requests through the proxy, with the key, through the ``openai`` client (streamed and not),
  give one instance's greedy output, and D pulled the prompts' KV from P;
- every HTTP door (P, D, the proxy) refuses a stranger (401, streamed and not);
- a decode instance whose CURVE key P does not allow gets nothing: P logs the refusal, the
  request is recomputed on that D (``kv_load_failure_policy="recompute"``) with the same output,
  and P frees the held blocks at lease expiry (none leaked);
- neither the API key nor any CURVE secret key appears in any process's log (the launcher shows
  the generated key once, on purpose).
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import ssl
import time

import httpx
import openai
import pytest

from security_utils import assert_no_secrets, make_tls, metric, start
from server_utils import (CLUSTER_PROMPTS as PROMPTS, CLUSTER_SERVER_ARGS as SERVER_ARGS,
                          NUM_CLUSTER_REQUESTS as NUM_REQUESTS, complete_in_turn, free_port,
                          launch_cluster, pid_alive, stop)

LEASE_S = 6.0


@pytest.fixture(scope="module")
def cluster(tiny_chat_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("secure_cluster")
    log_path = str(folder / "launch.log")
    tls = make_tls(str(folder))
    extra = ("--secure", "--prefill-host", "127.0.0.1", "--decode-host", "127.0.0.2",
             "--kv-extra-config", json.dumps({"kv_lease_duration": LEASE_S}),
             "--ssl-keyfile", tls["key"], "--ssl-certfile", tls["cert"], "--backend-ca", tls["ca"])
    with launch_cluster(tiny_chat_dir, log_path, "ZmqPullConnector", SERVER_ARGS, num_decode=1,
                        num_threads=2, extra_args=extra) as info:
        keys = [line.split(": ", 1)[1].strip() for line in open(log_path)
                if line.startswith("API key: ")]
        assert keys, open(log_path).read()[-3000:]
        curve = os.path.join(info["secrets_dir"], "curve")
        secret_keys = [re.search(r'secret-key = "(.+)"', open(os.path.join(curve, f)).read())
                       .group(1) for f in os.listdir(curve) if f.endswith(".key_secret")]
        yield {**info, "key": keys[0], "folder": folder, "secret_keys": secret_keys,
               "verify": ssl.create_default_context(cafile=tls["ca"])}


@pytest.fixture(scope="module")
def reference(tiny_chat_dir):
    from minivllm import LLM, SamplingParams
    llm = LLM(model=tiny_chat_dir, max_model_len=512, num_gpu_blocks_override=128)
    return [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]


def body(i: int, **kw) -> dict:
    return {"prompt": PROMPTS[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}


def test_two_hosts_secured_cluster_equals_one_instance(cluster, tiny_chat_dir, reference):
    assert cluster["prefill"][0].startswith("https://127.0.0.1:")
    assert cluster["decode"][0].startswith("https://127.0.0.2:")
    v = cluster["verify"]
    client = openai.OpenAI(base_url=cluster["proxy"] + "/v1", api_key=cluster["key"],
                           max_retries=0, timeout=120, http_client=httpx.Client(verify=v))

    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: complete_in_turn(client, tiny_chat_dir, PROMPTS, i),
                            range(NUM_REQUESTS)))
    assert got == reference
    records = httpx.get(cluster["proxy"] + "/proxy/requests", verify=v,
                        headers={"Authorization": f"Bearer {cluster['key']}"}).json()
    assert all(r["kv_transfer_params"]["remote_host"] == "127.0.0.1" for r in records)
    d, p = cluster["decode"][0], cluster["prefill"][0]
    assert metric(d, "minivllm:kv_connector_worker_num_loaded_tokens_total", v) >= \
        32 * NUM_REQUESTS
    assert metric(d, "minivllm:kv_connector_worker_num_load_errors_total", v) == 0
    deadline = time.monotonic() + 10             # P's held blocks go back on D's "done"
    while metric(p, "vllm:kv_cache_usage_perc", v) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(p, "vllm:kv_cache_usage_perc", v) == 0


def test_every_http_door_refuses_a_stranger(cluster, tiny_chat_dir):
    for url in (cluster["proxy"], *cluster["prefill"], *cluster["decode"]):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for stream in (False, True):
                r = httpx.post(url + "/v1/completions", headers=headers, timeout=30,
                               json={"model": tiny_chat_dir, **body(0, stream=stream)},
                               verify=cluster["verify"])
                assert r.status_code == 401 and r.json()["error"]["code"] == 401, (url, r.text)
        assert httpx.get(url + "/health", timeout=10, verify=cluster["verify"]).status_code == 200
        with pytest.raises(httpx.HTTPError):                # plain text against TLS
            httpx.get(url.replace("https://", "http://") + "/health", timeout=10)


def test_a_decode_key_p_does_not_allow_gets_nothing(cluster, tiny_chat_dir, reference, tmp_path):
    """A D with its own keypair (not in P's allowed folder) and P's public key: its pull is
    refused, it recomputes the prompt (same output), and P frees the blocks at lease expiry."""
    from minivllm.disagg.keys import make_keys
    stranger = make_keys(str(tmp_path / "stranger"), 1)["decode0"]
    stranger["curve_server_public_key_file"] = os.path.join(cluster["secrets_dir"], "curve",
                                                            "prefill.key")
    kv = {"kv_connector": "ZmqPullConnector", "kv_role": "kv_consumer",
          "kv_connector_extra_config": {**stranger, "timeout_s": 1.0}}
    port = free_port()
    url, log = f"http://127.0.0.2:{port}", str(tmp_path / "stranger.log")
    proc = start(["minivllm.serve", "--model", tiny_chat_dir, *SERVER_ARGS.split(),
                  "--num-threads", "1", "--host", "127.0.0.2", "--port", str(port),
                  "--kv-transfer-config", json.dumps(kv)], log, url,
                 env={"VLLM_API_KEY": cluster["key"]})
    try:
        auth = {"Authorization": f"Bearer {cluster['key']}"}
        p, v = cluster["prefill"][0], cluster["verify"]
        expired = metric(p, "minivllm:kv_connector_worker_num_leases_expired_total", v)
        r = httpx.post(p + "/v1/completions", headers=auth, timeout=60, verify=v, json={
            "model": tiny_chat_dir, **body(3, max_tokens=1),
            "kv_transfer_params": {"do_remote_decode": True}})
        params = r.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] and metric(p, "vllm:kv_cache_usage_perc", v) > 0
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=60, json={
            "model": tiny_chat_dir, **body(3), "kv_transfer_params": params})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference[3]
        assert metric(url, "minivllm:kv_connector_worker_num_load_errors_total") == 1
        assert metric(url, "minivllm:kv_connector_worker_num_loaded_tokens_total") == 0
        deadline = time.monotonic() + LEASE_S + 15
        while (metric(p, "minivllm:kv_connector_worker_num_leases_expired_total", v) == expired
               and time.monotonic() < deadline):
            time.sleep(0.3)
        assert metric(p, "minivllm:kv_connector_worker_num_leases_expired_total", v) == \
            expired + 1
        assert metric(p, "vllm:kv_cache_usage_perc", v) == 0
        p_log = open(os.path.join(cluster["log_dir"], "prefill0.log")).read()
        public = open(stranger["curve_public_key_file"]).read()
        assert "refused a side-channel peer" in p_log
        assert re.search(r'public-key = "(.+)"', public).group(1) in p_log
        assert "P does not answer a key it does not allow" in open(log).read()
    finally:
        stop(proc)
    assert_no_secrets([log], [cluster["key"], *cluster["secret_keys"]])


def test_no_secret_in_any_log_and_the_launcher_cleans_up(cluster):
    proc = cluster["launcher"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert not [n for n, pid in cluster["pids"].items() if pid_alive(pid)]
    assert not os.path.exists(cluster["secrets_dir"])
    logs = [os.path.join(cluster["log_dir"], f) for f in os.listdir(cluster["log_dir"])]
    assert len(logs) == 3            # prefill0, decode0, proxy
    assert_no_secrets([cluster["log"], *logs], [cluster["key"], *cluster["secret_keys"]],
                      allowed={cluster["log"]: (cluster["key"], 1)})
