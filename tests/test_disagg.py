"""A real P/D cluster from ``python -m minivllm.disagg.launch`` (a Redis KV store, 1 prefill and 2
decode servers, the proxy, all on 127.0.0.1): 20 requests through the proxy give one instance's
greedy outputs and the decode instances report KV loaded from the store; a decode server killed
mid-run and then the prefill server killed: the proxy routes around them, every request completes
or fails with a clear error; stopping the launcher stops every child."""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import httpx
import openai
import pytest

from server_utils import launch_cluster, metric, pid_alive

NUM_REQUESTS = 20
SERVER_ARGS = "--max-model-len 512 --num-gpu-blocks-override 128"
# Prompts of more than two 16-token blocks, so that the decode side has whole blocks to load.
PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog, then the dog sleeps under "
           f"the old oak tree while the fox counts to {i * 7} and back again." for i in
           range(NUM_REQUESTS)]



@pytest.fixture(scope="module")
def model_dir(tiny_chat_dir) -> str:
    return tiny_chat_dir


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    log_path = str(tmp_path_factory.mktemp("launch") / "launch.log")
    with launch_cluster(model_dir, log_path, "RedisStoreConnector", SERVER_ARGS) as info:
        yield info


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster["proxy"] + "/v1", api_key="EMPTY", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def reference(model_dir):
    from minivllm import LLM, SamplingParams
    llm = LLM(model=model_dir, max_model_len=512, num_gpu_blocks_override=128)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def complete(client, model: str, i: int, stream: bool = False) -> str:
    kw = dict(model=model, prompt=PROMPTS[i], max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)
                   if c.choices)


def test_20_requests_equal_one_instance_with_kv_hits(cluster, client, reference, model_dir):
    assert httpx.get(cluster["proxy"] + "/health").status_code == 200
    with cf.ThreadPoolExecutor(5) as pool:
        got = list(pool.map(lambda i: complete(client, model_dir, i, stream=i % 2 == 1),
                            range(NUM_REQUESTS)))
    assert got == reference
    records = httpx.get(cluster["proxy"] + "/proxy/requests").json()
    assert len(records) == NUM_REQUESTS
    assert {r["decode"] for r in records} == set(cluster["decode"])   # round robin over both
    assert all(r["prefill_error"] is None and r["kv_transfer_params"] for r in records)
    loaded = [metric(u, "minivllm:kv_connector_worker_num_loaded_tokens_total")
              for u in cluster["decode"]]
    assert all(n >= 32 for n in loaded), loaded
    # The same, seen by a client: prompt tokens the decode instance did not compute itself.
    r = client.completions.create(model=model_dir, prompt=PROMPTS[0] + " Again.", max_tokens=2,
                                  temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 32


def test_decode_killed_mid_run(cluster, client, reference, model_dir):
    """Long requests in flight on both decode instances; one is killed. Non-streamed requests are
    retried on the other one and complete; a stream cut off mid-way ends in a clear error."""
    victim_url, victim = cluster["decode"][0], cluster["pids"]["decode0"]

    def long_request(i: int):
        kw = dict(model=model_dir, prompt=PROMPTS[i], max_tokens=300, temperature=0,
                  extra_body={"ignore_eos": True})
        try:
            if i % 2:
                return "".join(c.choices[0].text for c in
                               client.completions.create(**kw, stream=True) if c.choices)
            return client.completions.create(**kw).choices[0].text
        except openai.APIError as e:
            return e

    with cf.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(long_request, i) for i in range(6)]
        deadline = time.monotonic() + 60
        while metric(victim_url, "vllm:num_requests_running") == 0:
            assert time.monotonic() < deadline, "no request reached the decode instance"
            time.sleep(0.1)
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=180) for f in futures]
    for i, r in enumerate(results):
        if isinstance(r, Exception):
            assert i % 2 == 1 and "decode instance failed" in str(r), repr(r)
        else:
            assert isinstance(r, str) and len(r) > 0
    assert sum(isinstance(r, str) for r in results) >= 3     # every non-streamed one
    # New requests all go to the survivor.
    assert [complete(client, model_dir, i) for i in range(3)] == reference[:3]


def test_prefill_killed_decode_recomputes(cluster, client, reference, model_dir):
    os.kill(cluster["pids"]["prefill0"], signal.SIGKILL)
    time.sleep(0.5)
    got = [complete(client, model_dir, i, stream=i == 1) for i in range(3)]
    assert got == reference[:3]
    records = httpx.get(cluster["proxy"] + "/proxy/requests").json()[-3:]
    assert all(r["prefill_error"] for r in records)
    assert httpx.get(cluster["proxy"] + "/health").status_code == 503


def test_launcher_stops_every_child(cluster):
    proc = cluster["launcher"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in cluster["pids"].values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [n for n, p in cluster["pids"].items() if pid_alive(p)]
    assert "stopped every child" in open(cluster["log"]).read()
