"""The P/D fleet on a real two-node Ray cluster (``ray.cluster_utils.Cluster``): one node carries
the ``prefill`` resource, the other ``decode``; a tiny random model with SmolLM2's tokenizer.

One module-scoped fleet serves every test here (starting Ray, Serve and four engines costs most
of the time); each test leaves it idle at its minimum for the next.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from minivllm.disagg.fleet.app import ROUTING_STATS_PERIOD_S, FleetConfig  # noqa: E402
from minivllm.disagg.fleet.autoscale import FleetTargets  # noqa: E402
from minivllm.disagg.fleet.driver import start_fleet  # noqa: E402

KEY = "fleet-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def node_ports() -> dict:
    """A node's agent ports, fixed (free ones) rather than left to Ray to choose."""
    from minivllm.disagg.launch import free_port
    return {k: free_port("127.0.0.1") for k in ("metrics_agent_port", "metrics_export_port",
                                                "dashboard_agent_listen_port",
                                                "runtime_env_agent_port")}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {"prefill": 1}, **node_ports()})
    cluster.add_node(num_cpus=4, resources={"decode": 1}, **node_ports())
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        assert len(ray.nodes()) == 2
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def fleet(cluster, tiny_chat_dir):
    config = FleetConfig(model=tiny_chat_dir, replica_num_cpus=1, node_ip=False,
                         api_keys=[KEY], router="kv", pd_min_uncached_tokens=64,
                         server_args=["--max-model-len", "1024"],     # the engine's defaults
                         metrics_interval_s=0.25, look_back_period_s=0.5,
                         drain_timeout_s=20)
    targets = FleetTargets(prefill_min=1, prefill_max=2, decode_min=1, decode_max=2,
                           prefill_target_queued_tokens=1000, decode_target_running=3,
                           upscale_delay_s=0.5, downscale_delay_s=2.0)
    f = start_fleet(config, targets, startup_timeout=180)
    try:
        yield f
    finally:
        f.stop()


def _complete(fleet, prompt, max_tokens=8, **kw):
    r = httpx.post(fleet.url + "/v1/completions", headers=AUTH, timeout=120,
                   json={"model": fleet.config.model, "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _deployed_config_text():
    """Everything Serve shows of its applications (``serve config``, the dashboard read this)."""
    from ray.serve.context import _get_global_client
    details = _get_global_client().get_serve_details()
    assert details["applications"]["minivllm-fleet"]["deployed_app_config"]["args"]["config"]
    return json.dumps(details, default=str)


def _wait(fleet, pred, timeout):
    deadline = time.monotonic() + timeout
    view = fleet.view()
    while not pred(view):
        assert time.monotonic() < deadline, json.dumps(view)[:2000]
        time.sleep(0.25)
        view = fleet.view()
    return view


def test_redis_store_fleet_across_nodes_with_its_own_secured_store(cluster, tiny_chat_dir):
    """``RedisStoreConnector`` without ``kv_store_url``: the fleet starts the store on this node's
    address, with a random password under ``secure``; prefill (head node) writes the KV there and
    decode (the other node) reads it. Two decode replicas: a conversation's second turn goes to
    the one that holds its first. First in the module: Serve runs one fleet at a time."""
    import os

    import redis

    from minivllm import LLM, SamplingParams
    config = FleetConfig(model=tiny_chat_dir, kv_connector="RedisStoreConnector", secure=True,
                         replica_num_cpus=1, api_keys=[KEY], pd_min_uncached_tokens=0,
                         server_args=["--max-model-len", "1024"])
    f = start_fleet(config, FleetTargets(1, 1, 2, 2), startup_timeout=180)
    try:
        store = f.kv_store
        assert store["password"] and "@" not in store["url"]
        assert config.kv_store_url is None and f.config.kv_store_url      # the caller's untouched
        shown = _deployed_config_text()          # the keys live in FleetState only
        assert KEY not in shown
        assert not store["url"].startswith("redis://127.0.0.1")      # the node's address
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(store["url"], socket_timeout=5).ping()
        prompts = [f"Request {i}: the quick brown fox number {i * 7} jumps over the lazy dog, "
                   "then it runs back across the green field to its den" for i in range(4)]
        got = [_complete(f, p)["choices"][0]["text"] for p in prompts]
        want = [o.outputs[0].text for o in LLM(model=tiny_chat_dir, seed=0, max_model_len=1024)
                .generate(prompts, SamplingParams(temperature=0, max_tokens=8))]
        assert got == want
        view = httpx.get(f.url + "/fleet", headers=AUTH, timeout=30).json()["kv_store"]
        assert view == {"connector": "RedisStoreConnector", "url": store["url"], "path": None,
                        "started_by_fleet": True, "password": True}
        password = f._store.password
        with redis.Redis.from_url(store["url"], password=password, socket_timeout=5) as client:
            assert client.keys("mv:*") and client.info("stats")["keyspace_hits"] > 0
        _second_turn_goes_where_the_first_is_held(f)
    finally:
        f.stop()
    assert not os.path.exists(f"/proc/{store['pid']}")          # Redis stopped with the fleet


def _second_turn_goes_where_the_first_is_held(f):
    """Over two decode replicas, each conversation's second turn is picked where its first turn's
    blocks are (their KV events said so), whichever replica that was."""
    time.sleep(ROUTING_STATS_PERIOD_S + 0.5)    # the replicas have reported their events' address
    firsts = {}
    for i in range(2):
        messages = [{"role": "user", "content": f"Conversation {i}. " + CONVERSATION[0]}]
        text, rid = _chat(f, messages)
        firsts[i] = (messages + [{"role": "assistant", "content": text},
                                 {"role": "user", "content": CONVERSATION[1]}], _route(f, rid))
    assert all(len(route["candidates"]) == 2 for _, route in firsts.values()), firsts
    time.sleep(0.5)                             # the first turns' events have reached the index
    for messages, first in firsts.values():
        second = _route(f, _chat(f, messages)[1])
        held = {c["replica"]: c["cached_blocks"] for c in second["candidates"]}
        assert second["pick"] == first["served_by"] == second["served_by"], second
        assert held[second["pick"]] > max(v for r, v in held.items() if r != second["pick"])


def test_greedy_outputs_equal_one_instance(fleet):
    from minivllm import LLM, SamplingParams
    prompts = [f"Request {i}: the quick brown fox number {i * 7}" for i in range(20)]
    with cf.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: _complete(fleet, p)["choices"][0]["text"], prompts))
    llm = LLM(model=fleet.config.model, seed=0, max_model_len=1024)
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0,
                                                                            max_tokens=8))]
    assert got == want


def test_openai_surface_streaming_auth_and_400s(fleet):
    url = fleet.url + "/v1/completions"
    assert httpx.post(url, json={"prompt": "x"}, timeout=30).status_code == 401
    assert httpx.get(fleet.url + "/fleet", timeout=30).status_code == 401
    for bad in ({"model": "m", "prompt": "x", "max_tokens": -1}, {"model": "m"}, [1, 2]):
        r = httpx.post(url, json=bad, headers=AUTH, timeout=30)
        assert r.status_code == 400, r.text
        assert "error" in r.json()
    body = {"model": fleet.config.model, "prompt": "Once upon", "max_tokens": 6,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60,
                      headers={**AUTH, "X-Request-Id": "fleet-req-1"}) as r:
        assert r.status_code == 200 and r.headers["X-Request-Id"] == "fleet-req-1"
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == _complete(fleet, "Once upon", 6)["choices"][0]["text"]
    view = httpx.get(fleet.url + "/fleet", headers=AUTH, timeout=30).json()
    assert view["prefill"]["replicas"] >= 1 and view["decode"]["min"] == 1
    assert view["decisions"] and {"time", "prefill", "decode", "reason"} <= set(view["decisions"][-1])


def test_keys_stay_out_of_serve_and_a_running_serve_keeps_its_port(fleet):
    """The clients' key is nowhere in what Serve shows; the replicas serve no HTTP of their own
    (the ingress calls them through handles). A second fleet asking the running Serve for another
    port is refused before it starts anything; the running fleet is untouched."""
    from minivllm.disagg.fleet.app import FleetConfigError
    shown = _deployed_config_text()
    assert KEY not in shown
    port = int(fleet.url.rsplit(":", 1)[1])
    before = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    with pytest.raises(FleetConfigError, match=f"127.0.0.1:{port}.*--port {port + 1}"):
        start_fleet(FleetConfig(model=fleet.config.model), port=port + 1)
    assert {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)} == before
    assert _complete(fleet, "still here", 4)["choices"][0]["text"] is not None
    models = httpx.get(fleet.url + "/v1/models", headers=AUTH, timeout=30).json()
    assert models["data"][0]["id"] == fleet.config.model


def _chat(fleet, messages, max_tokens=12):
    r = httpx.post(fleet.url + "/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"model": fleet.config.model, "messages": messages,
                         "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.headers["X-Request-Id"]


def _route(fleet, request_id, timeout=10):
    deadline = time.monotonic() + timeout
    while True:
        routes = [r for r in fleet.records()["routes"] if r["request_id"] == request_id]
        if routes or time.monotonic() > deadline:
            assert routes, request_id
            return routes[0]
        time.sleep(0.2)


# A first turn long enough (about 120 tokens with the chat template) to be prefilled remotely
# under pd_min_uncached_tokens=64; the next turns add less than 64 new tokens each.
STORY = ("A lighthouse keeper lived alone on a rock far out at sea, where he kept the lamp "
         "burning every night, wrote the weather in his log, and watched the ships go by. ")
CONVERSATION = ["Here is a story. " + STORY * 3 + "Tell me what happens when a storm comes.",
                "Now tell it from the point of view of the storm.",
                "Here is another story. " + STORY * 3 + "Tell me about the ships."]


def _offline_chat(model, messages, max_tokens=12):
    from minivllm import LLM, SamplingParams
    from minivllm.model_executor.model_loader import load_tokenizer
    tok = load_tokenizer(model)
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    llm = LLM(model=model, seed=0, max_model_len=1024)
    return llm.generate([{"prompt_token_ids": ids}],
                        SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0].text


def test_a_second_turn_goes_where_the_first_is_cached_and_skips_the_remote_prefill(fleet):
    """Turn 1: nothing cached anywhere, prefilled remotely. Turn 2: the decode replica that served
    turn 1 holds its blocks (its KV events said so), so the router picks it and, with at most
    ``pd_min_uncached_tokens`` left to compute, it computes them itself: no remote prefill. The
    greedy text equals one engine's."""
    messages = [{"role": "user", "content": CONVERSATION[0]}]
    text1, rid1 = _chat(fleet, messages)
    first = _route(fleet, rid1)
    assert first["remote_prefill"] is True and first["served_by"]
    messages += [{"role": "assistant", "content": text1},
                 {"role": "user", "content": CONVERSATION[1]}]
    time.sleep(ROUTING_STATS_PERIOD_S + 0.5)    # the replicas have reported their events' address
    text2, rid2 = _chat(fleet, messages)
    second = _route(fleet, rid2)
    held = {c["replica"]: c["cached_blocks"] for c in second["candidates"]}
    assert second["pick"] == first["served_by"] == second["served_by"], second
    assert held[second["pick"]] > 0 and second["remote_prefill"] is False, second
    assert second["prefill"] is None
    assert text2 == _offline_chat(fleet.config.model, messages)
def _load_until(fleet, stop, errors, prompt, max_tokens):
    import random
    while not stop.is_set():      # a new prefix each time: no prefix-cache hit
        try:
            _complete(fleet, f"{random.random()} {prompt}", max_tokens, ignore_eos=True)
        except Exception as e:          # noqa: BLE001  collected: any failure fails the test
            errors.append(repr(e))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_role_scales_under_its_own_load_and_back(fleet, role):
    """Long prompts, one token each, queue only prompt tokens; short prompts with long
    generations only fill the decode batch. Each must grow its own role, not the other. Driven
    over HTTP by more clients than Serve's default of 5 per replica, with the engine's default
    token budget (a whole burst is scheduled in one step: prefill must still see it)."""
    import threading
    _wait(fleet, lambda v: v["prefill"]["replicas"] == 1 and v["decode"]["replicas"] == 1, 60)
    other = "decode" if role == "prefill" else "prefill"
    prompt, max_tokens, clients = (("lorem ipsum dolor " * 120, 1, 8) if role == "prefill"
                                   else ("hi", 400, 12))
    stop, errors, other_max = threading.Event(), [], 1
    threads = [threading.Thread(target=_load_until, args=(fleet, stop, errors, prompt, max_tokens))
               for _ in range(clients)]
    t_burst = time.time()
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 90
        while True:
            v = fleet.view()
            other_max = max(other_max, v[other]["replicas"])
            if v[role]["replicas"] == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert v[role]["replicas"] == 2, json.dumps(v)[:2000]
        time.sleep(2.0)                 # the new replica takes part (no failure while it joins)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert other_max == 1
    _wait(fleet, lambda v: v["prefill"]["replicas"] == 1 and v["decode"]["replicas"] == 1, 60)
    deadline = time.monotonic() + 30        # the stopped replica drains, then says so
    while not [e for e in fleet.records()["events"] if e.get("event") == "drained"
               and e["role"] == role]:
        assert time.monotonic() < deadline, fleet.records()["events"]
        time.sleep(0.25)
    rec = fleet.records()
    decided = min(d["time"] for d in rec["decisions"] if d[role] == 2 and d["time"] > t_burst)
    serving = min(e["time"] for e in rec["events"] if e["role"] == role
                  and e["event"] == "serving" and e["time"] > t_burst)
    drain = [e["drain_s"] for e in rec["events"] if e["role"] == role and e["event"] == "drained"]
    print(f"\nFLEET {role}: burst -> decision {decided - t_burst:.1f} s, -> new replica serving "
          f"{serving - t_burst:.1f} s; drain {drain[-1]:.1f} s")


def test_killed_decode_replica(fleet):
    _wait(fleet, lambda v: v["decode"]["replicas"] == 1, 60)
    deadline = time.monotonic() + 40          # a replica stopped by the scale-down may still drain
    while True:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if "#decode#" in a["name"]]
        if len(names) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert len(names) == 1, names
    messages = [{"role": "user", "content": CONVERSATION[2]}]       # a conversation's first turn
    text1, _ = _chat(fleet, messages)
    body = {"model": fleet.config.model, "prompt": "hi", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", fleet.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "choices" in first
        killed = time.time()
        ray.kill(ray.get_actor(names[0], namespace="serve"))
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    # a clean end: either an OpenAI error event then [DONE], or the answer completed
    assert rest[-1] == "[DONE]"
    # The dead replica leaves the pools; Serve starts another, which serves.
    deadline = time.monotonic() + 90
    while not [e for e in fleet.records()["events"] if e["role"] == "decode"
               and e["event"] == "serving" and e["time"] > killed]:
        assert time.monotonic() < deadline, fleet.records()["events"]
        time.sleep(0.25)
    assert any(e["event"] == "lost" for e in fleet.records()["events"])
    _wait(fleet, lambda v: v["decode"]["replicas"] == 1 and v["prefill"]["replicas"] == 1, 30)
    assert _complete(fleet, "after the fault", 4)["choices"][0]["text"] is not None
    # The conversation's next turn: the replica that held it is gone and forgotten, so a miss
    # (nothing cached, a remote prefill), and the same greedy text as one engine's.
    messages += [{"role": "assistant", "content": text1}, {"role": "user", "content": "Shorter."}]
    text2, rid = _chat(fleet, messages)
    route = _route(fleet, rid)
    assert all(c["cached_blocks"] == 0 for c in route["candidates"]), route
    assert route["remote_prefill"] is True
    assert text2 == _offline_chat(fleet.config.model, messages)
    # Nothing stays held or running. Serve averages each metric over ``look_back_period_s``, so
    # ``running_requests`` reaches 0 a look-back after the last request ends, not with the KV.
    _wait(fleet, lambda v: v["decode"]["metrics"].get("kv_cache_usage", 1) == 0
          and v["prefill"]["metrics"].get("kv_cache_usage", 1) == 0
          and v["decode"]["metrics"].get("running_requests", 1) == 0, 30)


def _replica_nodes(cluster, role):
    """{actor name: node id} of the role's live replica actors (Ray's state API, this cluster)."""
    from ray.util.state import list_actors
    alive = list_actors(address=cluster.address, filters=[("state", "=", "ALIVE")], limit=1000)
    return {a.name: a.node_id for a in alive if a.name and f"#{role}#" in a.name}


def test_removed_node_replicas_come_back_elsewhere(fleet, cluster):
    """The node holding the decode replica leaves the cluster (``Cluster.remove_node``: its raylet
    and every worker on it are killed). Serve starts the replica again on the node left that
    carries the ``decode`` resource, within the policy's bounds, and requests succeed."""
    _wait(fleet, lambda v: v["decode"]["replicas"] == 1 and v["prefill"]["replicas"] == 1, 60)
    spare = cluster.add_node(num_cpus=4, resources={"decode": 1}, **node_ports())
    doomed = [n for n in cluster.worker_nodes if n is not spare][0]
    deadline = time.monotonic() + 40          # a replica stopped by a scale-down may still drain
    while len(before := _replica_nodes(cluster, "decode")) != 1:
        assert time.monotonic() < deadline, before
        time.sleep(0.25)
    assert list(before.values()) == [doomed.node_id]
    removed = time.time()
    cluster.remove_node(doomed)
    deadline = time.monotonic() + 90
    while not [e for e in fleet.records()["events"] if e["role"] == "decode"
               and e["event"] == "serving" and e["time"] > removed]:
        assert time.monotonic() < deadline, fleet.records()["events"]
        time.sleep(0.25)
    v = _wait(fleet, lambda v: v["decode"]["replicas"] == 1 and v["prefill"]["replicas"] == 1, 30)
    assert 1 <= v["decode"]["replicas"] <= v["decode"]["max"]
    assert set(_replica_nodes(cluster, "decode").values()) == {spare.node_id}
    got = [_complete(fleet, f"after the node left {i}", 4)["choices"][0]["text"] for i in range(3)]
    assert all(isinstance(t, str) for t in got)
    back = min(e["time"] for e in fleet.records()["events"] if e["role"] == "decode"
               and e["event"] == "serving" and e["time"] > removed)
    print(f"\nFLEET node removed -> decode replica serving on the node left {back - removed:.1f} s")
