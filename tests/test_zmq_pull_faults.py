"""ZmqPullConnector with a real prefill process: the flow, the lease and the faults of the pull
model. P runs in a child process (``peer_main`` below, driven by JSON lines on stdin, stepping its
engine between commands as a server loop does); the decode instances are engines in this process.

- flow: D's greedy output equals a colocated run, D loaded the prompt, P's pool is back to full;
- two D instances pulling different requests at once each get exactly their own blocks;
- D never reads, or a D process is killed mid-pull: P frees at lease expiry (logged with the
  request id), and a late read is refused;
- bad reads (another engine, unknown request, blocks it does not hold) are refused, and D applies
  kv_load_failure_policy: "recompute" gives the colocated output, "fail" finish_reason "error";
- abort on D during the pull frees D's blocks after the pull stops, and P's at D's "done";
- P dies mid-pull: "recompute" gives the colocated output, "fail" an error; D never hangs.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import pytest

from conftest import tiny_llm
from minivllm import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[(7 * i + 3 + 11 * k) % 256 for i in range(26 + 3 * k)] for k in range(3)]
LEASE_S = 4.0


# ---------------------------------------------------------------------- the P process
def peer_main() -> None:
    """P: ``python -c "import test_zmq_pull_faults as t; t.peer_main()" MODEL LEASE [DIE_AFTER]``."""
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    model, lease = sys.argv[1], float(sys.argv[2])
    die_after = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    llm = tiny_llm(model, kv_transfer_config={"kv_connector": "ZmqPullConnector",
                                              "kv_role": "kv_producer", "kv_lease_duration": lease})
    engine = llm.llm_engine
    pool = engine.scheduler.kv_cache_manager.block_pool
    total = pool.get_num_free_blocks()
    conn = engine.engine_core.worker.kv_connector
    answer, reads = conn._answer, [0]

    def answer_and_maybe_die(msg):   # the fault: P's process ends in the middle of a pull
        if msg["op"] == "read":
            reads[0] += 1
            if die_after and reads[0] > die_after:
                os._exit(3)
            time.sleep(float(os.environ.get("PEER_READ_DELAY_S", "0")))
        return answer(msg)
    conn._answer = answer_and_maybe_die
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [commands.put(json.loads(l)) for l in sys.stdin],
                     daemon=True).start()
    print("PEER " + json.dumps({"ready": True, "total": total}), flush=True)
    while True:
        try:
            cmd = commands.get(timeout=0.005)
        except queue.Empty:
            if engine.has_requests():
                engine.step()
            continue
        if cmd["op"] == "prefill":
            engine.add_request(cmd["id"], {"prompt_token_ids": cmd["prompt"]},
                               SamplingParams(temperature=0.0, max_tokens=1),
                               kv_transfer_params={"do_remote_decode": True})
            out = None
            while engine.has_unfinished_requests():
                out = (engine.step() or [out])[-1]
            reply = {"params": out.kv_transfer_params}
        elif cmd["op"] == "state":
            reply = {"free": pool.get_num_free_blocks(), "total": total,
                     "requests": sorted(engine.scheduler.requests)}
        else:
            return
        print("PEER " + json.dumps(reply), flush=True)


class Peer:
    def __init__(self, model: str, log_path: str, die_after: int = 0, read_delay_s: float = 0.0):
        env = {**os.environ, "PEER_READ_DELAY_S": str(read_delay_s),
               "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__),
                                              os.environ.get("PYTHONPATH", "")])}
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import test_zmq_pull_faults as t; t.peer_main()", model,
             str(LEASE_S), str(die_after)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=open(log_path, "w"), text=True, env=env)
        self.total = self._read(120)["total"]

    def _read(self, timeout: float) -> dict:
        result: list = []
        t = threading.Thread(target=lambda: result.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        line = result[0] if result else ""
        assert line.startswith("PEER "), f"P said {line!r}; log: {open(self.log_path).read()[-2000:]}"
        return json.loads(line[5:])

    def ask(self, timeout: float = 30, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def wait_free(self, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            state = self.ask(op="state")
            if state["free"] == self.total or time.monotonic() > deadline:
                return state
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def peer(tiny_llama_dir, tmp_path_factory):
    p = Peer(tiny_llama_dir, str(tmp_path_factory.mktemp("peer") / "p.log"))
    yield p
    p.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def decoder(model, policy="recompute"):
    engine = tiny_llm(model, enable_prefix_caching=False, kv_transfer_config={
        "kv_connector": "ZmqPullConnector", "kv_role": "kv_consumer",
        "kv_load_failure_policy": policy, "kv_connector_extra_config": {"timeout_s": 1.0}}).llm_engine
    engine.free0 = engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    return engine


def decode(engines_and_requests, max_seconds: float = 30.0) -> dict:
    """Step every D engine in turn until each request finished; returns req_id -> output."""
    done, deadline = {}, time.monotonic() + max_seconds
    for engine, rid, prompt, params in engines_and_requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, GREEDY, kv_transfer_params=params)
    engines = {id(e): e for e, *_ in engines_and_requests}.values()
    while len(done) < len(engines_and_requests):
        assert time.monotonic() < deadline, "D hangs"
        for engine in engines:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
    return done


def d_stats(engine) -> dict:
    return engine.engine_core.worker.kv_connector.get_stats()


def assert_d_clean(engine) -> None:
    deadline = time.monotonic() + 10
    while engine.has_requests() and time.monotonic() < deadline:
        engine.step()
    s = engine.scheduler
    assert s.requests == {} and s.kv_cache_manager.block_pool.get_num_free_blocks() == engine.free0


def test_pull_flow_and_two_decoders(peer, reference, tiny_llama_dir):
    d1, d2 = decoder(tiny_llama_dir), decoder(tiny_llama_dir)
    params = [peer.ask(op="prefill", id=f"flow{k}", prompt=PROMPTS[k])["params"] for k in range(3)]
    assert params[0]["do_remote_prefill"] and not params[0]["do_remote_decode"]
    assert len(params[0]["remote_block_ids"]) == 1   # one list per KV-cache group, as vLLM
    assert len(params[0]["remote_block_ids"][0]) == -(-len(PROMPTS[0]) // 4)
    held = peer.ask(op="state")
    assert held["total"] - held["free"] == sum(len(p["remote_block_ids"][0]) for p in params)
    out = decode([(d1, "a", PROMPTS[0], params[0])])
    assert out["a"].token_ids == reference[0]
    assert d_stats(d1)["num_loaded_tokens"] == len(PROMPTS[0]) and d_stats(d1)["num_load_errors"] == 0
    # Two instances at once, different requests: each gets its own blocks.
    out = decode([(d1, "b", PROMPTS[1], params[1]), (d2, "c", PROMPTS[2], params[2])])
    assert out["b"].token_ids == reference[1] and out["c"].token_ids == reference[2]
    assert d_stats(d2)["num_loaded_tokens"] == len(PROMPTS[2]) and d_stats(d2)["num_load_errors"] == 0
    state = peer.wait_free()
    assert state["free"] == peer.total and state["requests"] == []   # freed on finished_sending
    assert_d_clean(d1), assert_d_clean(d2)


def test_lease_expiry_frees_unread_blocks_and_late_read_is_refused(peer, reference, tiny_llama_dir):
    d = decoder(tiny_llama_dir)
    params = peer.ask(op="prefill", id="unread", prompt=PROMPTS[0])["params"]
    assert peer.ask(op="state")["free"] < peer.total
    t0 = time.monotonic()
    state = peer.wait_free(timeout=LEASE_S + 5)
    assert state["free"] == peer.total and state["requests"] == []
    assert LEASE_S - 0.5 <= time.monotonic() - t0 <= LEASE_S + 5
    assert "lease of request 'unread' expired" in open(peer.log_path).read()
    # D comes too late: refused, recomputed.
    assert decode([(d, "late", PROMPTS[0], params)])["late"].token_ids == reference[0]
    assert d_stats(d)["num_load_errors"] == 1
    assert_d_clean(d)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_bad_reads_are_refused(peer, reference, tiny_llama_dir, policy):
    d = decoder(tiny_llama_dir, policy)
    good = peer.ask(op="prefill", id=f"bad-{policy}", prompt=PROMPTS[1])["params"]
    other = peer.ask(op="prefill", id=f"other-{policy}", prompt=PROMPTS[0])["params"]
    bad = [{**good, "remote_engine_id": "minivllm-someone-else"},       # another engine's
           {**good, "remote_request_id": "never-held"},                  # unknown request
           {**good, "remote_block_ids": [other["remote_block_ids"][0]
                                          + good["remote_block_ids"][0]]}]
    out = decode([(d, f"x{i}", PROMPTS[1], p) for i, p in enumerate(bad)])
    for i in range(len(bad)):
        if policy == "fail":
            assert out[f"x{i}"].finish_reason == "error" and out[f"x{i}"].token_ids == []
        else:
            assert out[f"x{i}"].token_ids == reference[1]
    assert d_stats(d)["num_load_errors"] == len(bad)
    assert decode([(d, "good", PROMPTS[1], good)])["good"].token_ids == reference[1]
    assert decode([(d, "o", PROMPTS[0], other)])["o"].token_ids == reference[0]
    assert peer.wait_free()["free"] == peer.total
    assert_d_clean(d)


def test_abort_on_d_during_the_pull(tiny_llama_dir, tmp_path):
    p = Peer(tiny_llama_dir, str(tmp_path / "slow.log"), read_delay_s=0.3)
    try:
        d = decoder(tiny_llama_dir)
        params = p.ask(op="prefill", id="ab", prompt=PROMPTS[2])["params"]
        d.add_request("ab", {"prompt_token_ids": PROMPTS[2]}, GREEDY, kv_transfer_params=params)
        d.step()                                         # the pull starts (2 layers, 0.3 s each)
        d.abort_request(["ab"])
        assert "ab" in d.scheduler.requests              # blocks held while the pull runs
        assert_d_clean(d)
        state = p.wait_free(timeout=LEASE_S - 1)     # D told P it is done, before the lease
        assert state["free"] == p.total and state["requests"] == []
    finally:
        p.stop()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_p_dies_mid_pull(tiny_llama_dir, tmp_path, reference, policy):
    p = Peer(tiny_llama_dir, str(tmp_path / "dies.log"), die_after=1)
    try:
        d = decoder(tiny_llama_dir, policy)
        params = p.ask(op="prefill", id="dies", prompt=PROMPTS[0])["params"]
        t0 = time.monotonic()
        out = decode([(d, "dies", PROMPTS[0], params)], max_seconds=20)["dies"]
        assert p.proc.wait(timeout=10) == 3              # P really died after one layer
        assert time.monotonic() - t0 < 10
        if policy == "fail":
            assert out.finish_reason == "error" and out.token_ids == []
        else:
            assert out.token_ids == reference[0]
        assert d_stats(d)["num_load_errors"] == 1
        assert_d_clean(d)
    finally:
        p.stop()


def test_d_killed_mid_pull_p_frees_at_lease_expiry(peer):
    """A D process reads layer 0 of P's blocks, then is killed (SIGKILL) before "done": P frees
    the blocks when the lease expires, and its pool is back to its free count."""
    params = peer.ask(op="prefill", id="dkill", prompt=PROMPTS[2])["params"]
    read = {"op": "read", "engine_id": params["remote_engine_id"], "req_id": "dkill",
            "block_ids": params["remote_block_ids"][0], "layer": 0}
    code = (f"import json, os, signal, zmq\n"
            f"s = zmq.Context().socket(zmq.REQ)\n"
            f"s.connect('tcp://{params['remote_host']}:{params['remote_port']}')\n"
            f"s.send(json.dumps({read!r}).encode())\n"
            f"frames = s.recv_multipart()\n"
            f"print(json.loads(frames[0])['status'], len(frames[1]), flush=True)\n"
            f"os.kill(os.getpid(), signal.SIGKILL)\n")
    d = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert d.returncode == -9 and d.stdout.startswith("ok "), d.stderr
    assert peer.ask(op="state")["free"] < peer.total          # still held: no "done" came
    state = peer.wait_free(timeout=LEASE_S + 5)
    assert state["free"] == peer.total and state["requests"] == []
    assert "lease of request 'dkill' expired" in open(peer.log_path).read()
