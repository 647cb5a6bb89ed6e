"""The KV store's door: ``python -m minivllm.kvstore --password-file`` as a real process (the
printed URL carries the password in redis-py's form, the redis-server's command line does not),
``RedisStoreConnector`` refusing to start on a missing or wrong password whatever
``on_unavailable`` says (naming the store, never the password), P/D through the guarded store
giving a single instance's output, and the TLS error of the bundled (TLS-less) redis-server.
Every log line and exception of these runs is scanned for the password."""
from __future__ import annotations

import logging
import secrets
import subprocess
import sys

import pytest
import redis

from minivllm import LLM, SamplingParams
from minivllm.config import KVTransferConfig
from server_utils import child_env, free_port, stop

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 200 for j in range(n)]}
           for i, n in enumerate((20, 41))]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A password-guarded ``python -m minivllm.kvstore`` on TCP, yielding (url, password, file)."""
    d = tmp_path_factory.mktemp("kvstore")
    password = "pw-" + secrets.token_urlsafe(16)
    (d / "pass").write_text(password + "\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "minivllm.kvstore", "--port", str(port),
                             "--password-file", str(d / "pass")], stdout=subprocess.PIPE,
                            stderr=open(d / "stderr.log", "w"), text=True, env=child_env())
    try:
        url = proc.stdout.readline().strip()
        yield {"url": url, "password": password, "file": str(d / "pass"), "port": port,
               "proc": proc, "stderr": str(d / "stderr.log")}
    finally:
        stop(proc)
    assert password not in open(d / "stderr.log").read()


def ktc(url, role, **extra) -> KVTransferConfig:
    return KVTransferConfig("RedisStoreConnector", role, {"url": url, "chunk_size": 16, **extra})


def test_printed_url_carries_the_password_and_the_server_wants_it(store):
    url, password, port = store["url"], store["password"], store["port"]
    assert url == f"redis://:{password}@127.0.0.1:{port}/0"
    assert redis.Redis.from_url(url).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(f"redis://127.0.0.1:{port}/0").ping()
    # The password is in a private config file, not on redis-server's command line.
    ps = subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
    assert f"127.0.0.1:{port}" in ps and password not in ps


@pytest.mark.parametrize("on_unavailable", ["error", "recompute"])
@pytest.mark.parametrize("password", [None, "wrong-password"])
def test_connector_refuses_to_start_without_the_password(store, tmp_path, caplog, on_unavailable,
                                                         password):
    from minivllm.distributed.kv_transfer.factory import validate_kv_transfer_config
    bare = f"redis://127.0.0.1:{store['port']}/0"
    url = bare if password is None else f"redis://:{password}@127.0.0.1:{store['port']}/0"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(PermissionError) as e:        # at once, never a retry loop
        validate_kv_transfer_config(ktc(url, "kv_consumer", on_unavailable=on_unavailable))
    msg = str(e.value)
    assert "RedisStoreConnector" in msg and f"127.0.0.1:{store['port']}" in msg
    assert "password_file" in msg
    for secret in (store["password"], "wrong-password"):
        assert secret not in msg and secret not in caplog.text
        assert secret not in repr(e.value.__context__)


def test_pd_through_the_guarded_store(store, tiny_llama_dir, caplog, capfd):
    """P and D read the password from a file (the URL they are given has none); D's greedy
    output equals a single instance's and its KV came from the store."""
    caplog.set_level(logging.DEBUG)
    bare = f"redis://127.0.0.1:{store['port']}/0"
    kw = dict(model=tiny_llama_dir, block_size=8, num_gpu_blocks_override=64,
              skip_tokenizer_init=True)
    ref = [o.outputs[0].token_ids for o in LLM(**kw).generate(PROMPTS, GREEDY, use_tqdm=False)]
    p = LLM(**kw, kv_transfer_config=ktc(bare, "kv_producer", password_file=store["file"]))
    outs = p.generate(PROMPTS, PREFILL, use_tqdm=False)
    assert all(o.kv_transfer_params for o in outs)
    d = LLM(**kw, enable_prefix_caching=False,
            kv_transfer_config=ktc(bare, "kv_consumer", password_file=store["file"]))
    got = d.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                              extra_args={"kv_transfer_params": o.kv_transfer_params})
                               for o in outs], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == ref
    assert d.llm_engine.engine_core.worker.kv_connector.get_stats()["num_loaded_tokens"] == 16 + 40
    assert store["password"] not in repr(d.llm_engine.engine_core.worker.kv_connector)
    out, err = capfd.readouterr()
    assert store["password"] not in out + err + caplog.text


def test_tls_needs_a_tls_build_the_bundled_one_says_so(tmp_path):
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("")
    r = subprocess.run([sys.executable, "-m", "minivllm.kvstore", "--port", str(free_port()),
                        "--tls-cert-file", str(tmp_path / "cert.pem"), "--tls-key-file",
                        str(tmp_path / "key.pem"), "--tls-ca-cert-file", str(tmp_path / "ca.pem")],
                       capture_output=True, text=True, timeout=60, env=child_env())
    assert r.returncode == 1 and r.stdout == ""
    assert "built without TLS" in r.stderr and "MINIVLLM_REDIS_SERVER" in r.stderr, r.stderr


def test_launcher_secure_gives_the_store_a_password_file(tmp_path):
    """``launch --secure`` with RedisStoreConnector: a random password in a 0600 file of a private
    folder, the store started with it and its URL without it; an instance given the file gets
    in; the folder goes when the cluster stops."""
    import os
    from minivllm.disagg import launch
    from minivllm.distributed.kv_transfer.factory import validate_kv_transfer_config
    cluster = launch.Cluster("http://127.0.0.1:1", [], [], "RedisStoreConnector", "", str(tmp_path))
    try:
        guard = cluster._secure_files("RedisStoreConnector", 1)
        pw_file = guard["password_file"]
        assert os.stat(pw_file).st_mode & 0o777 == 0o600
        assert os.stat(cluster.secrets_dir).st_mode & 0o777 == 0o700
        url = cluster._start_redis(child_env(), pw_file)
        password = open(pw_file).read().strip()
        assert url.startswith("redis://127.0.0.1:") and password not in url
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url).ping()
        assert redis.Redis.from_url(url, password=password).ping()
        validate_kv_transfer_config(ktc(url, "kv_consumer", password_file=pw_file))
        with pytest.raises(PermissionError):
            validate_kv_transfer_config(ktc(url, "kv_consumer"))
    finally:
        cluster.stop()
    assert not os.path.exists(cluster.secrets_dir)


def test_curve_config_is_checked_before_any_weights_load(tmp_path, caplog):
    """The roles' CURVE keys are checked at validation (a clear ValueError), and a side channel
    beyond loopback without CURVE is a one-line warning naming the keys."""
    from minivllm.disagg.keys import make_keys
    from minivllm.distributed.kv_transfer.factory import validate_kv_transfer_config
    from minivllm.distributed.kv_transfer.zmq_pull_curve import warn_if_open
    keys = make_keys(str(tmp_path / "keys"), 2)

    def check(role, **extra):
        validate_kv_transfer_config(KVTransferConfig("ZmqPullConnector", role, extra))
    check("kv_producer", **keys["prefill"])
    check("kv_consumer", **keys["decode1"])
    bad = [("kv_producer", {**keys["prefill"], "curve_allowed_clients_dir": None},
            "curve_allowed_clients_dir"),
           ("kv_consumer", {**keys["decode0"], "curve_server_public_key_file": None},
            "curve_server_public_key_file"),
           ("kv_consumer", {**keys["decode0"], "curve_public_key_file":
                            keys["decode1"]["curve_public_key_file"]}, "not the public half"),
           ("kv_consumer", {**keys["decode0"], "curve_secret_key_file":
                            keys["decode0"]["curve_public_key_file"]}, "holds no secret key"),
           ("kv_consumer", {**keys["decode0"], "curve_secret_key_file": str(tmp_path / "none")},
            "minivllm.disagg.keys")]
    for role, extra, words in bad:
        with pytest.raises(ValueError, match=words):
            check(role, **{k: v for k, v in extra.items() if v is not None})
    with caplog.at_level(logging.WARNING):
        warn_if_open("127.0.0.2")
        assert caplog.records == []
        warn_if_open("0.0.0.0")
    assert "curve_secret_key_file" in caplog.text and "0.0.0.0" in caplog.text


def test_allowed_keys_follow_the_folder(tmp_path, caplog):
    """P's ZAP callback: the folder's keys and P's own are allowed; a key removed from the folder
    is refused within a second, logged once (its public key, never a secret)."""
    import os
    import time
    import zmq.auth
    from minivllm.disagg.keys import make_keys
    from minivllm.distributed.kv_transfer.zmq_pull_curve import _AllowedKeys
    keys = make_keys(str(tmp_path / "keys"), 1)
    own = zmq.auth.load_certificate(keys["prefill"]["curve_public_key_file"])[0]
    d0 = zmq.auth.load_certificate(keys["decode0"]["curve_public_key_file"])[0]
    allowed = _AllowedKeys(keys["prefill"]["curve_allowed_clients_dir"], own)
    assert allowed.callback("*", own) and allowed.callback("*", d0)
    os.remove(os.path.join(keys["prefill"]["curve_allowed_clients_dir"], "decode0.key"))
    time.sleep(1.1)
    with caplog.at_level(logging.WARNING):
        assert not allowed.callback("*", d0) and not allowed.callback("*", d0)
    assert allowed.callback("*", own)
    assert len(caplog.records) == 1 and d0.decode() in caplog.text
    secret = zmq.auth.load_certificate(keys["decode0"]["curve_secret_key_file"])[1]
    assert secret.decode() not in caplog.text


def test_a_server_without_the_password_stops_at_start(store, tiny_llama_dir):
    """``python -m minivllm.serve`` given the store's URL without its password ends at once (no
    retry loop, before any weights load) with the error naming the store."""
    import json
    import time
    kv = {"kv_connector": "RedisStoreConnector", "kv_role": "kv_consumer",
          "kv_connector_extra_config": {"url": f"redis://:nope@127.0.0.1:{store['port']}/0",
                                        "on_unavailable": "recompute"}}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "minivllm.serve", "--model", tiny_llama_dir,
                        "--port", str(free_port()), "--kv-transfer-config", json.dumps(kv)],
                       capture_output=True, text=True, timeout=120, env=child_env())
    out = r.stdout + r.stderr
    assert r.returncode != 0 and time.monotonic() - t0 < 60
    assert f"the KV store at redis://:***@127.0.0.1:{store['port']}/0 refused" in out, out[-2000:]
    assert "nope" not in out and store["password"] not in out
