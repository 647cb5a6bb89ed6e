"""RedisStoreConnector against a real redis-server (started here, stopped by PID): P stores, D
loads synchronously or asynchronously (vLLM's WAITING_FOR_REMOTE_KVS path), and D's greedy output
equals a single instance's, token for token; the keys are content addresses."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
import redis
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer import redis_store
from minivllm.distributed.kv_transfer.redis_server import RedisServer
from minivllm.request import RequestStatus

BS, CHUNK = 8, 16
LENGTHS = (3, 8, 9, 17, 40, 70)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ktc(url, role, **extra) -> KVTransferConfig:
    return KVTransferConfig("RedisStoreConnector", role, {"url": url, "chunk_size": CHUNK, **extra})


def llm(model, kv=None, **kw) -> LLM:
    kw = {"block_size": BS, "num_gpu_blocks_override": 64, "skip_tokenizer_init": True, **kw}
    return LLM(model=model, kv_transfer_config=kv, **kw)


def prompts(seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in lengths]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture()
def url(server):
    redis.Redis.from_url(server.url).flushall()
    return server.url


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def reference(model):
    return {seed: tokens(llm(model).generate(prompts(seed), GREEDY, use_tqdm=False)) for seed in (0, 1)}


def worker_stats(engine: LLM) -> dict:
    return engine.llm_engine.engine_core.worker.kv_connector.get_stats()


@pytest.mark.parametrize("load_async", [False, True])
def test_p_stores_d_loads_same_output(model, url, reference, load_async):
    p = llm(model, ktc(url, "kv_producer"))
    outs = p.generate(prompts(), PREFILL, use_tqdm=False)
    # kv_transfer_params: what P stored, for D (None where no whole block lies below the last token).
    assert [o.kv_transfer_params and o.kv_transfer_params["num_tokens"] for o in outs] == \
        [None, None, 8, 16, 32, 64]
    d = llm(model, ktc(url, "kv_consumer", load_async=load_async), enable_prefix_caching=False)
    got = d.generate(prompts(), [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                extra_args={"kv_transfer_params": o.kv_transfer_params})
                                 for o in outs], use_tqdm=False)
    assert tokens(got) == reference[0]
    assert [o.num_cached_tokens for o in got] == [0, 0, 8, 16, 32, 64]
    stats = worker_stats(d)
    assert stats["num_loaded_tokens"] == 120 and stats["num_load_errors"] == 0


def test_keys_are_content_addresses(model, url):
    p = llm(model, ktc(url, "kv_producer"))
    ps = prompts(lengths=(70,))
    p.generate(ps, PREFILL, use_tqdm=False)
    client = redis.Redis.from_url(url)
    keys = sorted(k.decode() for k in client.keys("*"))
    metas = [k for k in keys if k.endswith(":meta")]
    n_layers = p.vllm_config.hf_config.num_hidden_layers
    # 64 tokens below the last one, chunks of 16: 4 chunks, each one meta + one value per layer.
    assert p.llm_engine.scheduler.connector.num_prompt_chunks(70) == len(metas) == 4
    assert len(keys) == 4 * (1 + n_layers)
    chunks = redis_store.chunk_prefix(ps[0]["prompt_token_ids"], 64, CHUNK)
    assert {c.hash for c in chunks} == {k.split(":")[2] for k in keys}
    # The same prompt again stores nothing new; a longer one sharing the prefix only its new chunks.
    p.generate(ps, PREFILL, use_tqdm=False)
    p.generate([{"prompt_token_ids": ps[0]["prompt_token_ids"] + [5] * 16}], PREFILL, use_tqdm=False)
    assert len(client.keys("*:meta")) == 5
    assert worker_stats(p)["num_chunks_committed"] == 5


def test_async_load_keeps_others_decoding(model, url):
    """The request whose KV loads goes WAITING -> WAITING_FOR_REMOTE_KVS -> WAITING -> RUNNING,
    while a running request gets a token in every step; in sync mode it never parks."""
    ps = prompts(1, lengths=(5, 70))
    llm(model, ktc(url, "kv_producer")).generate(ps, PREFILL, use_tqdm=False)
    ref = tokens(llm(model).generate(ps[1:], GREEDY, use_tqdm=False))[0]
    for load_async in (True, False):
        d = llm(model, ktc(url, "kv_consumer", load_async=load_async), enable_prefix_caching=False)
        engine = d.llm_engine
        engine.add_request("run", ps[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        engine.step()
        a = engine._requests["run"]
        engine.add_request("load", ps[1], GREEDY)
        b = engine._requests["load"]
        statuses, progress = [b.status], []
        for _ in range(20):
            if b.is_finished():
                break
            before = a.num_output_tokens
            engine.step()
            statuses.append(b.status)
            progress.append(a.num_output_tokens - before)
        assert b.output_token_ids == ref
        assert all(n == 1 for n in progress), progress      # "run" never stalls
        seen = [s for i, s in enumerate(statuses) if i == 0 or s != statuses[i - 1]]
        if load_async:
            assert seen[:3] == [RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS,
                                RequestStatus.RUNNING]
        else:
            assert RequestStatus.WAITING_FOR_REMOTE_KVS not in statuses
        assert b.num_cached_tokens == 64


def test_kv_transfer_params_through_add_request(model, url):
    d = llm(model, ktc(url, "kv_consumer"))
    req = d.llm_engine.add_request("x", prompts()[2], GREEDY, kv_transfer_params={"num_tokens": 0})
    assert req.kv_transfer_params == {"num_tokens": 0}
    with pytest.raises(ValueError, match="kv_transfer_params"):
        d.llm_engine.add_request("y", prompts()[2], GREEDY, kv_transfer_params=[1])


def test_bad_extra_config_fails_before_weights(tmp_path):
    missing = str(tmp_path / "no-model")
    for extra, match in [({"url": "http://x"}, "url"), ({"load_async": 1}, "load_async"),
                         ({"chunk_size": 0}, "chunk_size"), ({"on_unavailable": "x"}, "on_unavailable"),
                         ({"bogus": 1}, "unknown keys")]:
        with pytest.raises(ValueError, match=match):
            LLM(model=missing, kv_transfer_config=KVTransferConfig("RedisStoreConnector", "kv_both", extra))


def test_kvstore_cli_prints_url_and_stops_on_sigterm():
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "minivllm.kvstore"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("unix://")
        client = redis.Redis.from_url(url, socket_timeout=5)
        assert client.ping()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        with pytest.raises((redis.ConnectionError, FileNotFoundError)):
            redis.Redis.from_url(url, socket_timeout=2).ping()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_kvstore_keeps_its_name_and_loads_no_torch():
    """``minivllm.kvstore`` re-exports the server's module (the command and the imports keep
    working), and the command's process never loads torch: it only watches a redis-server."""
    import minivllm.kvstore as kvstore
    from minivllm.distributed.kv_transfer import redis_server
    for name in kvstore.__all__:
        assert getattr(kvstore, name) is getattr(redis_server, name)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", "import sys, minivllm.kvstore; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_owned_server_without_url(model, reference):
    """No "url": the process starts its own server, shared by P and D in this process."""
    kv = lambda role: KVTransferConfig("RedisStoreConnector", role, {"chunk_size": CHUNK})  # noqa: E731
    p = llm(model, kv("kv_producer"))
    p.generate(prompts(), PREFILL, use_tqdm=False)
    from minivllm.distributed.kv_transfer.redis_server import owned_server
    assert p.llm_engine.scheduler.connector.url == owned_server().url
    d = llm(model, kv("kv_consumer"), enable_prefix_caching=False)
    got = d.generate(prompts(), GREEDY, use_tqdm=False)
    assert tokens(got) == reference[0] and worker_stats(d)["num_loaded_tokens"] == 120


def test_abort_during_async_load_frees_blocks_after_the_load(model, url):
    """A request aborted while its KV loads keeps its blocks until the worker reports the load
    (the loader thread may still write into them), then frees them."""
    ps = prompts(3, lengths=(70,))
    llm(model, ktc(url, "kv_producer")).generate(ps, PREFILL, use_tqdm=False)
    d = llm(model, ktc(url, "kv_consumer"), enable_prefix_caching=False)
    engine, sched = d.llm_engine, d.llm_engine.scheduler
    free0 = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    worker_conn, gate = engine.engine_core.worker.kv_connector, threading.Event()
    load = worker_conn._load_request
    worker_conn._load_request = lambda req: (gate.wait(30), load(req))[1]   # hold the fetch
    engine.add_request("x", ps[0], GREEDY)
    engine.add_request("keep", prompts(4, lengths=(5,))[0], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    assert engine._requests["x"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.abort_request(["x"])
    assert "x" in sched.requests            # blocks held: the load is still in flight
    engine.step()
    assert "x" in sched.requests
    gate.set()
    for _ in range(50):
        if "x" not in sched.requests:
            break
        engine.step()
    assert "x" not in sched.requests
    engine.abort_request(["keep"])
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == free0
