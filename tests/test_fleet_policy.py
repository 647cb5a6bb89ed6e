"""The fleet's autoscaling policy (minivllm/disagg/fleet/autoscale.py) on recorded metric series,
without Ray; the fleet command without Ray installed; the fleet's config checks, the Serve config it
deploys and the HTTP options it takes (disagg/fleet/app.py); the records ``GET /fleet`` shows
(fleet/replicas.py, ``FleetState``)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from minivllm.disagg.fleet.autoscale import FleetTargets, decide, role_metrics

T = FleetTargets(prefill_min=1, prefill_max=3, decode_min=1, decode_max=3,
                 prefill_target_queued_tokens=1000, decode_target_running=4,
                 upscale_delay_s=1.0, downscale_delay_s=5.0)


def run(series, targets=T, start=(1, 1), dt=0.5):
    """Feed ``series`` (one ``{"prefill": {...}, "decode": {...}}`` per tick, ``dt`` apart) to
    ``decide`` as Serve would; returns the counts after every tick."""
    cur, state, out = {"prefill": start[0], "decode": start[1]}, {}, []
    for i, m in enumerate(series):
        d = decide(m, cur, targets, state, now=i * dt)
        cur, state = {"prefill": d.num_prefill, "decode": d.num_decode}, d.state
        out.append((d.num_prefill, d.num_decode, d.reason))
    return out


def tick(queued=0.0, running=0.0, kv=0.0):
    return {"prefill": {"waiting_prompt_tokens": queued},
            "decode": {"running_requests": running, "kv_cache_usage": kv}}


def test_a_burst_of_long_prompts_scales_prefill_not_decode():
    out = run([tick(queued=2600, running=1)] * 6)
    assert out[0][:2] == (1, 1) and "wants 3" in out[0][2]      # not before the delay
    assert out[-1][:2] == (3, 1)
    assert "prefill 1->3" in out[2][2]


def test_long_generations_scale_decode_not_prefill():
    out = run([tick(queued=40, running=9)] * 6)
    assert out[-1][:2] == (1, 3)
    out = run([tick(running=2, kv=0.95)] * 4)                    # KV nearly full: one more
    assert out[-1][:2] == (1, 2) and "KV usage" in out[-1][2]


def test_idle_returns_both_to_min_after_the_down_delay():
    out = run([tick()] * 12, start=(3, 3))
    assert [o[:2] for o in out[:10]] == [(3, 3)] * 10             # 5 s at 0.5 s a tick
    assert out[10][:2] == (1, 1)


def test_no_flapping_on_a_noisy_series():
    import random
    rng = random.Random(0)
    # load that swings around one replica's target, never above it for a whole second
    series = [tick(queued=rng.choice([700, 1300]) if i % 2 else 600,
                   running=rng.choice([3, 5]) if i % 2 else 2) for i in range(60)]
    out = run(series)
    assert {o[:2] for o in out} == {(1, 1)}


def test_bounds_and_targets_are_checked():
    assert run([tick(queued=10 ** 6, running=10 ** 3)] * 4)[-1][:2] == (3, 3)
    with pytest.raises(ValueError, match="prefill"):
        FleetTargets(prefill_min=2, prefill_max=1)
    with pytest.raises(ValueError, match="target"):
        FleetTargets(decode_target_running=0)


def test_role_metrics_sum_replicas_and_average_kv_usage():
    agg = {"running_requests": {"r1": 3.0, "r2": 5.0}, "kv_cache_usage": {"r1": 0.2, "r2": 0.6}}
    m = role_metrics("decode", agg)
    assert m["running_requests"] == 8.0 and m["kv_cache_usage"] == pytest.approx(0.4)
    assert role_metrics("prefill", {})["waiting_prompt_tokens"] == 0.0


def test_without_ray_the_command_exits_2_and_the_package_imports():
    code = ("import runpy, sys; sys.modules['ray'] = None\n"
            "import minivllm, minivllm.disagg.fleet.driver\n"
            "assert 'ray' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "sys.argv = ['fleet', '--prefill', '1:2']\n"
            "runpy.run_module('minivllm.disagg.fleet', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert 'pip install "minivllm[fleet]"' in r.stderr


def test_importing_minivllm_does_not_import_ray():
    code = "import sys, minivllm; from minivllm import LLM; print('ray' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr


def test_shared_storage_is_refused_where_the_folder_is_not_seen(tmp_path):
    from minivllm.disagg.fleet.replicas import MARKER, kv_transfer_config
    config = {"kv_connector": "SharedStorageConnector", "shared_storage_path": str(tmp_path)}
    with pytest.raises(RuntimeError, match="does not see the fleet's folder"):
        kv_transfer_config("decode", config, "10.0.0.2")
    (tmp_path / MARKER).touch()                  # what the fleet command writes where it runs
    kv = kv_transfer_config("decode", config, "10.0.0.2")
    assert kv["kv_role"] == "kv_consumer"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)
    zmq = kv_transfer_config("prefill", {"kv_connector": "ZmqPullConnector"}, "10.0.0.1")
    assert zmq["kv_connector_extra_config"]["side_channel_host"] == "10.0.0.1"


def test_config_checks():
    from minivllm.disagg.fleet.app import FleetConfig, check_config
    check_config(FleetConfig("m", "RedisStoreConnector"))            # the fleet starts the store
    check_config(FleetConfig("m", "RedisStoreConnector", kv_store_url="redis://h:6379/0"))
    with pytest.raises(ValueError, match="kv_connector must be one of"):
        check_config(FleetConfig("m", "NixlConnector"))
    with pytest.raises(ValueError, match="RedisStoreConnector's, not ZmqPullConnector's"):
        check_config(FleetConfig("m", "ZmqPullConnector", kv_store_url="redis://h:6379/0"))
    with pytest.raises(ValueError, match="must start with one of"):
        check_config(FleetConfig("m", "RedisStoreConnector", kv_store_url="http://h:6379"))
    with pytest.raises(ValueError, match="router must be one of"):
        check_config(FleetConfig("m", router="random"))
    with pytest.raises(ValueError, match="pd_min_uncached_tokens"):
        check_config(FleetConfig("m", pd_min_uncached_tokens=-1))


def test_store_url_warning_and_view_never_show_a_password():
    from minivllm.disagg.fleet.replicas import kv_transfer_config
    from minivllm.distributed.kv_transfer.redis_store import redacted
    from minivllm.distributed.kv_transfer.redis_server import store_url, unguarded_warning
    assert store_url("10.0.0.1", 6379) == "redis://10.0.0.1:6379/0"
    assert store_url("fd00::1", 6379) == "redis://[fd00::1]:6379/0"
    with pytest.raises(ValueError, match="TCP port"):
        store_url("10.0.0.1", 0)
    assert "without a password" in unguarded_warning("10.0.0.1", None)
    assert unguarded_warning("10.0.0.1", "pw") is None and unguarded_warning("127.0.0.1", None) is None
    assert redacted("redis://:s3cret@10.0.0.1:6379/0") == "redis://:***@10.0.0.1:6379/0"
    config = {"kv_connector": "RedisStoreConnector", "kv_store_url": "redis://10.0.0.1:6379/0"}
    extra = kv_transfer_config("decode", config, "10.0.0.2", "pw")["kv_connector_extra_config"]
    assert extra == {"url": "redis://10.0.0.1:6379/0", "password": "pw"}
    assert "password" not in kv_transfer_config("prefill", config, "h")["kv_connector_extra_config"]


def test_the_deployed_config_carries_no_key():
    """Serve keeps the application config in Ray's GCS and shows it (``serve config``): the keys
    go to FleetState (``keys()``), not into the ``ServeDeploySchema`` the fleet deploys."""
    import json
    from dataclasses import asdict

    from minivllm.disagg.fleet.app import FleetConfig, app_config
    from minivllm.disagg.fleet.replicas import APP
    config = FleetConfig("m", "RedisStoreConnector", api_keys=["client-key-1"],
                         secure=True, state_actor="fleet-state-x")
    app = app_config(config, T)
    assert "client-key-1" not in json.dumps(app)
    assert set(app["args"]["config"]) == set(asdict(config)) - {"api_keys"}
    assert app["args"]["targets"] == asdict(T) and app["name"] == APP
    assert app["autoscaling_policy"]["policy_kwargs"]["state_actor"] == "fleet-state-x"
    schema = pytest.importorskip("ray.serve.schema")     # pydantic only: no Ray starts
    deployed = schema.ServeDeploySchema(applications=[app]).model_dump_json()
    assert "client-key-1" not in deployed
    assert '"model":"m"' in deployed.replace(" ", "")


def test_a_running_serve_keeps_its_http_options():
    """Serve applies ``http_options`` only when it starts: joining a cluster whose Serve runs, the
    ingress is on that Serve's host and port; asking for others is an error naming them."""
    from minivllm.disagg.fleet.app import FleetConfigError, http_options
    from minivllm.disagg.fleet.driver import _parser
    assert http_options(None, None, None) == {"host": "127.0.0.1", "port": 8000}
    assert http_options("0.0.0.0", 0, None) == {"host": "0.0.0.0", "port": 0}   # 0: a free one
    running = {"host": "0.0.0.0", "port": 8000}
    for host, port in ((None, None), (None, 0), ("0.0.0.0", 8000), (None, 8000)):
        assert http_options(host, port, running) == running
    with pytest.raises(FleetConfigError, match=r"0\.0\.0\.0:8000.*--port 8004.*--port 8000"):
        http_options(None, 8004, running)
    with pytest.raises(FleetConfigError, match="--host 127.0.0.1 --port 8004"):
        http_options("127.0.0.1", 8004, running)
    text = " ".join(_parser().format_help().split())
    assert "already runs" in text and "an error naming them" in text


def test_fleet_lists_a_decision_only_when_a_count_or_a_wish_changes():
    """Every tick goes to the ``metrics`` series; ``/fleet``'s decisions are the changes, with
    times a person reads, and each role shows only its own metrics beside the replicas' events."""
    from minivllm.disagg.fleet.autoscale import ROLE_METRICS, FleetAutoscalingPolicy
    from minivllm.disagg.fleet.replicas import FleetState
    state = FleetState({"prefill": [1, 2], "decode": [1, 2]})
    policy = FleetAutoscalingPolicy(upscale_delay_s=1.0, downscale_delay_s=5.0)
    series = [tick()] * 20 + [tick(queued=1500)] * 4 + [tick()] * 20
    current = {"prefill": 1, "decode": 1}
    for i, m in enumerate(series):
        d = decide(m, current, policy.targets, policy.state, now=i * 0.5)
        policy.state, current = d.state, {"prefill": d.num_prefill, "decode": d.num_decode}
        metrics = {r: dict(m[r], kv_cache_usage=0.0, running_requests=0.0) for r in m}
        state.record_decision({"time": 1.8e9 + i * 0.5, "prefill": d.num_prefill,
                               "decode": d.num_decode, "running": {}, "metrics": metrics,
                               "reason": d.reason,
                               "wishes": {r: d.state.get(f"{r}_wish") for r in m}})
    rec = state.records()
    assert len(rec["metrics"]) == len(series)
    # idle; the wish to grow; the growth; the wish to shrink; the shrink (after 5 s)
    assert [(x["prefill"], "wants" in x["reason"]) for x in rec["decisions"]] == [
        (1, False), (1, True), (2, False), (2, True), (1, False)]
    assert rec["decisions"][0]["at"].startswith("2027-01-15 08:00:00.000")
    state.record_event("decode", "r1", "serving")
    state.record_event("decode", "r2", "serving")
    state.record_event("decode", "r1", "draining")        # it said it drains
    state.record_event("decode", "r1", "lost")            # then the router saw it go: not lost
    state.record_event("decode", "r2", "lost")            # the router saw it go, undrained
    view = state.view()
    assert [e["event"] for e in view["events"]] == ["serving", "serving", "draining", "lost"]
    assert view["events"][-1]["at"] and view["decode"]["replicas"] == 0
    for role in ("prefill", "decode"):
        assert set(view[role]["metrics"]) <= set(ROLE_METRICS[role])
    assert "waiting_prompt_tokens" not in view["decode"]["metrics"]
    assert "running_requests" not in view["prefill"]["metrics"]


def test_prompt_tokens_count_until_their_prefill_finished():
    """A burst the default token budget schedules in one step still reads as queued while its
    forward runs: ``num_computed_tokens`` already says done, no first token exists yet."""
    from types import SimpleNamespace as R

    from minivllm.disagg.fleet.replicas import prompt_tokens_not_prefilled
    scheduled = [R(num_prompt_tokens=600, num_computed_tokens=600, num_cached_tokens=0,
                   num_output_tokens=0) for _ in range(8)]
    hit = R(num_prompt_tokens=600, num_computed_tokens=600, num_cached_tokens=512,
            num_output_tokens=0)
    waiting = R(num_prompt_tokens=300, num_computed_tokens=0, num_cached_tokens=-1,
                num_output_tokens=0)
    done = R(num_prompt_tokens=600, num_computed_tokens=601, num_cached_tokens=0,
             num_output_tokens=1)
    assert prompt_tokens_not_prefilled(scheduled + [hit, waiting, done]) == 8 * 600 + 88 + 300


def test_the_fleet_starts_a_ray_of_its_own_and_never_changes_the_callers_config(monkeypatch):
    """Without ``--address``: ``ray.init(address="local")``, never the cluster
    ``/tmp/ray/ray_current_cluster`` names; with one, join it (no CPU count: Ray refuses one)."""
    import dataclasses

    import ray

    from minivllm.disagg.fleet import app, driver
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    config = app.FleetConfig(model="m", secure=True, kv_connector="SharedStorageConnector")
    assert driver._start_ray(None, FleetTargets(), config) is True
    assert calls[-1]["address"] == "local" and calls[-1]["num_cpus"] >= 6
    assert driver._start_ray("auto", FleetTargets(), config) is False
    assert calls[-1]["address"] == "auto" and "num_cpus" not in calls[-1]
    before = dataclasses.asdict(config)
    filled = driver._with_fleet_defaults(config)
    try:
        assert dataclasses.asdict(config) == before
        assert filled.state_actor and filled.shared_storage_path
    finally:
        import os
        os.rmdir(filled.shared_storage_path)


def test_the_ingress_admits_more_than_serves_default_of_five():
    from minivllm.disagg.fleet import app
    assert app.INGRESS_MAX_ONGOING_REQUESTS >= 64
