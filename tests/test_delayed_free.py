"""Delayed free (vLLM's ``_free_request`` / ``_update_from_kv_xfer_finished`` / ``finish_requests``):
a connector that keeps a finished request's blocks until its worker reports ``finished_sending``,
and asynchronous loads that an abort must not free under the loader's feet. After any sequence of
finish, abort and preemption no block and no ``Scheduler.requests`` entry leaks.

``DelayingConnector`` is a real subclass of the base connector: the scheduler half tells the worker
half, in the metadata, which requests it holds and which it loads; the worker half reports them
done a given number of steps later (no data moves, the loaded blocks are zeroed)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from conftest import tiny_llm
from minivllm import SamplingParams
from minivllm.config import KVTransferConfig
from minivllm.distributed.kv_transfer import (KVConnectorBase_V1, KVConnectorFactory,
                                              KVConnectorMetadata)
from minivllm.distributed.kv_transfer.shared_storage_connector import align_to_block_size
from minivllm.request import RequestStatus

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "DelayingConnectorForTest"


@dataclass
class DelayMeta(KVConnectorMetadata):
    sends: dict[str, int] = field(default_factory=dict)              # req_id -> steps until sent
    loads: dict[str, tuple[list[int], int]] = field(default_factory=dict)   # blocks, steps


class DelayingConnector(KVConnectorBase_V1):
    """``kv_transfer_params``: ``{"send_steps": s}`` holds the blocks ``s`` steps after a normal
    finish; ``{"load_steps": l}`` loads the prompt's whole blocks asynchronously over ``l`` steps."""
    scheduler = None    # set by the test: checks the block ids handed to request_finished

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._loads, self._sends = {}, {}
        self.held: dict[str, list[int]] = {}
        self._pending_loads: dict[str, tuple[list[int], int]] = {}
        self._pending_sends: dict[str, int] = {}
        self._kv = {}
        self._tried: set[str] = set()

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        steps = (request.kv_transfer_params or {}).get("load_steps")
        n = align_to_block_size(request.num_prompt_tokens, self._vllm_config.cache_config.block_size)
        if (steps is None or request.num_preemptions or n <= num_computed_tokens
                or request.request_id in self._tried):    # a failed load is not retried
            return 0, False
        self._tried.add(request.request_id)
        return n - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            self._loads[request.request_id] = (blocks.get_block_ids()[0],
                                               request.kv_transfer_params["load_steps"])

    def build_connector_meta(self, scheduler_output):
        held = {b for ids in self.held.values() for b in ids}
        for r in scheduler_output.scheduled_new_reqs:
            assert not held & set(r.block_ids[0]), "a held block was handed to another request"
        for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            assert not held & set(ids[0] if ids else []), "a held block was handed out again"
        meta = DelayMeta(self._sends, self._loads)
        self._sends, self._loads = {}, {}
        return meta

    def update_connector_output(self, out):
        for req_id in out.finished_sending or ():
            self.held.pop(req_id)

    def request_finished(self, request, block_ids):
        s = self.scheduler
        if s is not None:   # only the blocks of computed tokens (vLLM 0.32)
            all_ids = s.kv_cache_manager.get_block_ids(request.request_id)[0]
            assert block_ids == all_ids[:-(-request.num_computed_tokens // s.block_size)]
        steps = (request.kv_transfer_params or {}).get("send_steps")
        if steps is None or request.status not in (RequestStatus.FINISHED_STOPPED,
                                                    RequestStatus.FINISHED_LENGTH_CAPPED):
            return False, None
        self._sends[request.request_id] = steps
        self.held[request.request_id] = list(block_ids)
        return True, {"held_block_ids": list(block_ids)}

    # worker side
    def register_kv_caches(self, kv_caches):
        self._kv = kv_caches

    def start_load_kv(self, forward_context, **kw):
        md = self._connector_metadata
        if md is None:
            return
        self._pending_sends.update(md.sends)
        for req_id, (block_ids, steps) in md.loads.items():
            for kv in self._kv.values():
                kv[:, block_ids] = 0
            self._pending_loads[req_id] = (block_ids, steps)

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, *a, **kw):
        pass

    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids):
        sent, recvd = set(), set()
        self._bad = set()
        for d, out in ((self._pending_sends, sent), (self._pending_loads, recvd)):
            for req_id in list(d):
                v = d[req_id]
                steps = v[1] if isinstance(v, tuple) else v
                if steps <= 0:
                    out.add(req_id)
                    if isinstance(v, tuple) and req_id.startswith("bad"):   # the load failed
                        self._bad.update(v[0])
                    del d[req_id]
                else:
                    d[req_id] = (v[0], steps - 1) if isinstance(v, tuple) else steps - 1
        return sent or None, recvd or None

    def get_block_ids_with_load_errors(self):
        return getattr(self, "_bad", set())


if NAME not in KVConnectorFactory._registry:
    KVConnectorFactory.register_connector(NAME, DelayingConnector)


def make_engine(model, spec=None, policy="recompute", **kw):
    llm = tiny_llm(model, spec, **kw, kv_transfer_config=KVTransferConfig(
        NAME, "kv_both", kv_load_failure_policy=policy))
    engine = llm.llm_engine
    engine.scheduler.connector.scheduler = engine.scheduler
    return engine


def free_blocks(engine) -> int:
    return engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def drain(engine, max_steps=200) -> None:
    for _ in range(max_steps):
        engine.step()
        if not engine.scheduler.requests:
            break


def assert_nothing_leaked(engine, total: int) -> None:
    s = engine.scheduler
    assert s.requests == {} and s.delayed_free == {} and not s.waiting_for_remote_kvs
    assert free_blocks(engine) == total
    assert not engine.has_requests()


PROMPT = [(7 * i + 3) % 256 for i in range(22)]


def test_finished_request_holds_its_blocks_until_finished_sending(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    total = free_blocks(engine)
    engine.add_request("p", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1),
                       kv_transfer_params={"send_steps": 3})
    out = []
    while engine.has_unfinished_requests():
        out += engine.step()
    assert out[-1].finished and out[-1].kv_transfer_params["held_block_ids"]
    held = out[-1].kv_transfer_params["held_block_ids"]
    assert len(held) == -(-len(PROMPT) // 4)          # the prompt's blocks, computed tokens only
    assert free_blocks(engine) == total - len(held) and "p" in engine.scheduler.requests
    assert engine.has_requests()                       # the engine keeps stepping for them
    for _ in range(3):
        engine.step()
        assert free_blocks(engine) == total - len(held)
    drain(engine, 5)
    assert_nothing_leaked(engine, total)


def test_abort_while_waiting_for_remote_kvs_frees_after_the_load(tiny_llama_dir):
    """The connector does not delay (request_finished returns False): the scheduler must."""
    engine = make_engine(tiny_llama_dir)
    total = free_blocks(engine)
    engine.add_request("d", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=4),
                       kv_transfer_params={"load_steps": 4})
    engine.step()
    req = engine.scheduler.requests["d"]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.abort_request(["d"])
    n_blocks = total - free_blocks(engine)
    assert n_blocks > 0 and "d" in engine.scheduler.requests   # the load still writes into them
    engine.step()
    assert total - free_blocks(engine) == n_blocks
    drain(engine, 10)
    assert_nothing_leaked(engine, total)


def test_random_finish_abort_preempt_sequences_leak_nothing(tiny_llama_dir):
    """Few blocks (preemption), n-gram drafts (blocks past the computed tokens), random sends,
    loads, lengths and aborts; seeded, so a failure replays."""
    rng = random.Random(0)
    engine = make_engine(tiny_llama_dir, {"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 1, "prompt_lookup_max": 2},
                         num_gpu_blocks_override=14)
    total = free_blocks(engine)
    preemptions = 0
    for round_ in range(3):
        live = []
        for i in range(6):
            rid = f"r{round_}-{i}"
            n = rng.choice([5, 9, 14, 20])
            prompt = [rng.choice([1, 2, 3, 5]) for _ in range(n)]
            params = {}
            if rng.random() < 0.6:
                params["send_steps"] = rng.randint(0, 4)
            if rng.random() < 0.4:
                params["load_steps"] = rng.randint(0, 3)
            engine.add_request(rid, {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True),
                               kv_transfer_params=params or None)
            live.append(rid)
        for step in range(200):
            if not engine.has_requests():
                break
            engine.step()
            if rng.random() < 0.15:
                victims = [r for r in live if r in engine.scheduler.requests
                           and not engine.scheduler.requests[r].is_finished()]
                if victims:
                    engine.abort_request([rng.choice(victims)])
        preemptions = engine.scheduler.num_preemptions_total
        assert_nothing_leaked(engine, total)
    assert preemptions > 0, "the test must exercise preemption"


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_kv_load_failure_policy(tiny_llama_dir, policy):
    """A load that fails: "recompute" (minivllm's default) gives the colocated output, "fail"
    (vLLM 0.32's default) finishes the request with finish_reason "error"; the engine lives on and
    the other request is untouched; nothing leaks either way."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = make_engine(tiny_llama_dir, policy=policy)
    total = free_blocks(engine)
    engine.add_request("bad", {"prompt_token_ids": PROMPT}, params, kv_transfer_params={"load_steps": 1})
    engine.add_request("ok", {"prompt_token_ids": PROMPT[::-1]}, params)
    done = {}
    for _ in range(30):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        if len(done) == 2:
            break
    assert done["ok"].finish_reason == "length" and len(done["ok"].token_ids) == 6
    if policy == "fail":
        assert done["bad"].finish_reason == "error" and done["bad"].token_ids == []
    else:
        plain = make_engine(tiny_llama_dir)
        plain.add_request("x", {"prompt_token_ids": PROMPT}, params)
        outs = []
        while plain.has_unfinished_requests():
            outs += plain.step()
        assert done["bad"].finish_reason == "length"
        assert done["bad"].token_ids == outs[-1].outputs[0].token_ids
    drain(engine, 10)
    assert_nothing_leaked(engine, total)
