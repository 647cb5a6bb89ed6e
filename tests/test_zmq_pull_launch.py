"""``python -m minivllm.disagg.launch --kv-connector ZmqPullConnector``: 1 prefill and 2 decode
servers and the unchanged proxy, no KV store. Requests through the proxy give one instance's greedy
outputs; the decode servers pulled the prompts from the prefill server, whose held blocks are all
freed again (on D's "done"); stopping the launcher stops every child."""
from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest

from server_utils import (CLUSTER_PROMPTS as PROMPTS, CLUSTER_SERVER_ARGS as SERVER_ARGS,
                          NUM_CLUSTER_REQUESTS as NUM_REQUESTS, complete_in_turn, free_port,
                          launch_cluster, metric)



@pytest.fixture(scope="module")
def cluster(tiny_chat_dir, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("launch") / "launch.log")
    with launch_cluster(tiny_chat_dir, log_path, "ZmqPullConnector", SERVER_ARGS) as info:
        yield info


def test_pull_cluster_equals_one_instance(cluster, tiny_chat_dir):
    from minivllm import LLM, SamplingParams
    llm = LLM(model=tiny_chat_dir, max_model_len=512, num_gpu_blocks_override=128)
    reference = [o.outputs[0].text for o in llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    client = openai.OpenAI(base_url=cluster["proxy"] + "/v1", api_key="EMPTY", max_retries=0,
                           timeout=120)

    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: complete_in_turn(client, tiny_chat_dir, PROMPTS, i),
                            range(NUM_REQUESTS)))
    assert got == reference
    assert cluster["kv_connector"] == "ZmqPullConnector" and "kvstore" not in cluster["pids"]
    records = httpx.get(cluster["proxy"] + "/proxy/requests").json()
    assert all(r["kv_transfer_params"]["do_remote_prefill"] for r in records)
    loaded = [metric(u, "minivllm:kv_connector_worker_num_loaded_tokens_total")
              for u in cluster["decode"]]
    assert all(n >= 32 for n in loaded), loaded
    p = cluster["prefill"][0]
    assert metric(p, "minivllm:kv_connector_scheduler_num_held_total") == NUM_REQUESTS
    deadline = time.monotonic() + 10           # P's held blocks go back on finished_sending
    while metric(p, "vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(p, "vllm:kv_cache_usage_perc") == 0
    assert metric(p, "minivllm:kv_connector_worker_num_leases_expired_total") == 0


def test_fail_policy_server_answers_an_error(tiny_chat_dir, tmp_path):
    """A decode server with kv_load_failure_policy="fail" whose P is gone: HTTP 500 for the
    request (plain and streamed), no hang, and the server keeps serving."""
    from server_utils import start_server, stop
    kv = {"kv_connector": "ZmqPullConnector", "kv_role": "kv_consumer",
          "kv_load_failure_policy": "fail", "kv_connector_extra_config": {"timeout_s": 1.0}}
    url, proc = start_server(["--model", tiny_chat_dir, "--max-model-len", "512",
                              "--kv-transfer-config", json.dumps(kv)], str(tmp_path / "d.log"))
    try:
        dead = {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": list(range(1, 40)), "remote_engine_id": "gone",
                "remote_request_id": "x", "remote_host": "127.0.0.1", "remote_port": free_port()}
        body = {"model": tiny_chat_dir, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                "kv_transfer_params": dead}
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "KV" in r.json()["error"]["message"]
        streamed = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=60).text
        assert "KV load failed" in streamed and "[DONE]" in streamed
        assert time.monotonic() - t0 < 30
        ok = httpx.post(url + "/v1/completions", json={**body, "kv_transfer_params": None}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        assert 'finished_reason="error"' in httpx.get(url + "/metrics").text
    finally:
        stop(proc)


def test_one_launch_never_hands_out_a_port_twice(monkeypatch):
    """The launcher picks every child's ports before the children bind them, so the OS may
    offer one port twice (a prefill's side channel, then its HTTP port: the server then failed
    to bind). ``free_port(host, taken)`` skips the ports already promised in this launch."""
    from minivllm.disagg import launch
    offered = iter([41001, 41001, 41002, 41001, 41003])

    class Probe:                 # the OS's answers, in the order above
        def __init__(self, *args):
            self.port = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(launch.socket, "socket", Probe)
    taken: set[int] = set()
    assert [launch.free_port("127.0.0.1", taken) for _ in range(3)] == [41001, 41002, 41003]
    assert taken == {41001, 41002, 41003}
    monkeypatch.undo()
    assert launch.free_port("127.0.0.1") > 0          # no set: the OS's answer as it is
