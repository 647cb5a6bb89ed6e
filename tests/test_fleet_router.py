"""The fleet's KV-aware routing without a cluster (disagg/fleet/kv_index.py, kv_pool.PoolView):
the index on recorded event streams (an engine's own, and hand-made ones with lost, late and
out-of-order events), its LRU bound, a replica cleared, Dynamo's score, the pick and its fallback,
the P/D decision."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("msgspec")

from minivllm.disagg.fleet.kv_index import (Candidate, KVIndex,  # noqa: E402
                                            needs_remote_prefill, pick, prompt_block_hashes,
                                            score)
from minivllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved,  # noqa: E402
                                            BlockStored)

BS = 4


def stored(hashes, parent=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent,
                       token_ids=[0] * BS * len(hashes), block_size=BS, lora_id=None,
                       medium="GPU", lora_name=None)


def removed(hashes):
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


@pytest.fixture(scope="module")
def recorded(tiny_llama_dir):
    """One turn of a conversation served by a real engine, its KV events recorded: the stream a
    replica would publish."""
    from conftest import tiny_llm

    from minivllm import SamplingParams
    from minivllm.distributed.kv_events import KVEventSubscriber
    llm = tiny_llm(tiny_llama_dir, kv_events_config={"enable_kv_cache_events": True,
                                                     "endpoint": "tcp://127.0.0.1:0"})
    publisher = llm.llm_engine.engine_core.scheduler.kv_event_publisher
    sub = KVEventSubscriber(publisher.endpoint)
    time.sleep(0.3)
    turn1 = [1 + (i * 7) % 90 for i in range(22)]
    out = llm.generate([{"prompt_token_ids": turn1}],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    # Until a quiet 0.3 s after the first batch (10 s at most). Every poll's batches are kept: a
    # batch that a poll returns and nobody keeps is a block the index never hears of.
    batches = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = sub.poll(0.3)
        if not got and batches:
            break
        batches += got
    sub.close()
    publisher.shutdown()
    return turn1, list(out), [b for _, b in batches]


def test_the_index_knows_what_an_engine_holds_and_a_second_turn_goes_there(recorded):
    turn1, reply, batches = recorded
    index = KVIndex()
    for b in batches:
        index.apply("r1", b.events)
    turn2 = turn1 + reply + [5, 6, 7, 8, 9, 10, 11]
    hashes = prompt_block_hashes(turn2, BS)
    # the first turn's prompt and the reply tokens the engine cached (all but the last, whose
    # KV was never computed), in full blocks
    held = (len(turn1) + len(reply) - 1) // BS
    assert index.prefix_blocks("r1", hashes) == held
    cands = [Candidate("r0", index.prefix_blocks("r0", hashes), 0),
             Candidate("r1", index.prefix_blocks("r1", hashes), 0)]
    assert pick(cands, len(hashes)).replica == "r1"
    assert [c.score for c in cands] == [len(hashes), len(hashes) - held]


def test_lru_bound_per_replica_and_a_replica_cleared():
    index = KVIndex(max_blocks_per_replica=3)
    index.apply("r1", [stored([b"a", b"b", b"c"])])
    assert index.prefix_blocks("r1", [b"a"]) == 1          # a is now the most recently used
    index.apply("r1", [stored([b"d", b"e"])])              # b, c leave first
    assert set(index.blocks["r1"]) == {b"a", b"d", b"e"} and b"b" not in index.holders
    index.apply("r2", [stored([b"a"])])
    index.forget("r1")                                     # left or restarted
    assert index.holders == {b"a": {"r2"}} and index.num_blocks("r1") == 0
    index.apply("r2", [AllBlocksCleared()])
    assert index.holders == {} and index.num_blocks("r2") == 0


def test_lost_late_and_out_of_order_events_cost_a_miss_not_an_error():
    """Only consecutive blocks from the start count; a removal that comes late (or twice, or for a
    block never stored) is harmless; an event lost makes the index wrong, never the pick invalid."""
    index = KVIndex()
    index.apply("r1", [stored([b"a"]), stored([b"c"], parent=b"b")])   # b's event was lost
    assert index.prefix_blocks("r1", [b"a", b"b", b"c"]) == 1
    index.apply("r1", [removed([b"zz"]), removed([b"a"]), removed([b"a"])])
    assert index.prefix_blocks("r1", [b"a", b"b", b"c"]) == 0
    index.apply("r2", [removed([b"x"]), stored([b"x"])])   # out of order: x looks held (stale)
    best = pick([Candidate("r1", 0, 0), Candidate("r2", index.prefix_blocks("r2", [b"x"]), 0)], 1)
    assert best.replica == "r2"               # a stale hint: at worst the engine recomputes x


def test_score_is_dynamos_and_ties_or_an_empty_index_go_to_the_least_loaded():
    assert score(10, 4, 7) == 6 + 7 and score(10, 4, 7, weight=2.0) == 12 + 7
    # 10 prompt blocks: r1 holds 8 but carries 30 blocks of decodes, r2 holds none and 5
    assert pick([Candidate("r1", 8, 30), Candidate("r2", 0, 5)], 10).replica == "r2"
    assert pick([Candidate("r1", 8, 3), Candidate("r2", 0, 5)], 10).replica == "r1"
    # empty index, equal scores: the fewest in flight, then the fewest blocks in use
    assert pick([Candidate("r1", 0, 0, 3), Candidate("r2", 0, 0, 1)], 4).replica == "r2"
    assert pick([], 4) is None


def test_a_remote_prefill_only_where_the_decode_replica_lacks_enough():
    assert needs_remote_prefill(100, 0, 16, 64)               # 100 uncached > 64
    assert not needs_remote_prefill(100, 4, 16, 64)           # 36 uncached: decode computes it
    assert needs_remote_prefill(100, 6, 16, 0)                # 0: always remote


def test_the_pool_subscribes_to_each_replicas_events_and_forgets_one_that_leaves():
    """``PoolView`` as the router keeps it: replicas (Serve's ``RunningReplica``: an id and its
    routing stats) with real publishers; one replica leaves and is forgotten and reported."""
    pytest.importorskip("ray.serve")
    from minivllm.disagg.fleet.kv_pool import PoolView
    from minivllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
    pubs = {uid: ZmqEventPublisher(endpoint="tcp://127.0.0.1:0",
                                   replay_endpoint="tcp://127.0.0.1:0") for uid in ("r1", "r2")}
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=uid), routing_stats={
        "kv_events_endpoint": p.endpoint, "kv_events_replay_endpoint": p.replay_endpoint,
        "block_size": BS}) for uid, p in pubs.items()]
    pool, left = PoolView("decode"), []
    pool.on_left = left.append
    try:
        pool.update(replicas)
        prompt = list(range(1, 14))
        assert pool.choose(prompt)[1]["candidates"][0]["cached_blocks"] == 0   # subscribes
        hashes = prompt_block_hashes(prompt, BS)
        # published before the first poll reached it? the replay fills the gap
        pubs["r2"].publish(KVEventBatch(ts=0.0, events=[stored(hashes[:2])]))
        pubs["r2"].publish(KVEventBatch(ts=1.0, events=[stored(hashes[2:], parent=hashes[1])]))
        deadline = time.monotonic() + 10
        while True:
            best, route = pool.choose(prompt, {"r1": 1, "r2": 1}, {"r1": 2, "r2": 2})
            if best == "r2" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert best == "r2" and route["cached_blocks"] == 3 and route["prompt_blocks"] == 3
        assert {c["replica"]: c["score"] for c in route["candidates"]} == {"r1": 5.0, "r2": 2.0}
        pool.update(replicas[:1])                        # r2 left (killed, or scaled down)
        assert left == ["r2"] and pool.index.num_blocks("r2") == 0
        assert pool.choose(prompt)[0] == "r1"
    finally:
        pool.update([])
        for p in pubs.values():
            p.shutdown()


def test_both_routers_keep_their_pool_and_choose_as_they_say():
    """``KVRouter`` and ``RoundRobinRouter`` share ``PoolRouter``'s pool (the one the ingress
    picks from); ``KVRouter`` takes the ingress's pick, ``RoundRobinRouter`` each candidate in
    turn. Serve builds routers with its own state; ``initialize_state`` and the choices are ours."""
    pytest.importorskip("ray.serve")
    import asyncio

    from minivllm.disagg.fleet.kv_pool import ROUTING_KWARG, pool_view
    from minivllm.disagg.fleet.kv_router import KVRouter, PoolRouter, RoundRobinRouter
    kv, rr = object.__new__(KVRouter), object.__new__(RoundRobinRouter)
    kv.initialize_state("router-test")
    rr.initialize_state("router-test")
    assert isinstance(kv, PoolRouter) and isinstance(rr, PoolRouter)
    assert kv.pool is rr.pool is pool_view("router-test")
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in ("b", "a")]
    turns = [asyncio.run(rr.choose_replicas(replicas))[0][0].replica_id.unique_id
             for _ in range(3)]
    assert turns == ["a", "b", "a"] and asyncio.run(rr.choose_replicas([])) == []
    # A models list (the ingress marks a GET "turn": False) asks "b", whose turn it is, and the
    # next chat still goes to "b": listing the models before each chat takes no turn.
    listing = SimpleNamespace(kwargs={ROUTING_KWARG: {"replica": None, "turn": False}})
    chat = SimpleNamespace(kwargs={ROUTING_KWARG: {"replica": None, "turn": True}})
    pairs = [(asyncio.run(rr.choose_replicas(replicas, listing))[0][0].replica_id.unique_id,
              asyncio.run(rr.choose_replicas(replicas, chat))[0][0].replica_id.unique_id)
             for _ in range(3)]
    assert pairs == [("b", "b"), ("a", "a"), ("b", "b")]
    picked = SimpleNamespace(kwargs={ROUTING_KWARG: {"replica": "b"}})
    assert asyncio.run(kv.choose_replicas(replicas, picked)) == [[replicas[0]]]


def test_the_fleet_figure_is_drawn_from_the_codes_own_names(tmp_path):
    """figures/fleet_routing.png: every label is read from the object it names."""
    pytest.importorskip("matplotlib")
    from minivllm.disagg.fleet import figure
    labels = figure.names()
    assert labels["score"] == score.__name__ and labels["ingress"] == "FleetIngress"
    assert (tmp_path / "f.png").exists() is False
    assert figure.draw(str(tmp_path / "f.png")) and (tmp_path / "f.png").stat().st_size > 0


def test_the_ingress_counts_a_request_on_its_pick_while_it_streams_and_not_after():
    """The score's load term is the ingress's own count (``FleetIngress._call``): a call counts
    its prompt blocks on the picked replica from its start, so that a pick made while it streams
    sees them, and drops them when the stream ends or the client goes away. The handle here
    stands in for Serve's ``DeploymentHandle`` (the cluster tests drive the real one)."""
    import asyncio
    from collections import Counter

    from minivllm.disagg.fleet.ingress import FleetIngress

    class Stream:                         # what ``handle.options(stream=True).generate.remote``
        def __init__(self, replica):      # returns: an async iterator with ``cancel``
            self.items, self.cancelled = [{"replica": replica, "status": 200}, b"a", b"b"], False
            self.counted_before_its_answer = None

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.counted_before_its_answer is None:
                self.counted_before_its_answer = proxy.blocks_in_flight["decode"]["r1"]
            if not self.items:
                raise StopAsyncIteration
            return self.items.pop(0)

        def cancel(self):
            self.cancelled = True

    streams = []

    class Handle:
        def options(self, stream):
            return self

        @property
        def generate(self):
            return SimpleNamespace(remote=lambda *a, **kw: streams.append(
                Stream(kw["routing"]["replica"] or "r9")) or streams[-1])

    proxy = object.__new__(FleetIngress)
    proxy.handles = {"decode": Handle()}
    proxy.ongoing, proxy.blocks_in_flight = {"decode": Counter()}, {"decode": Counter()}

    async def run():
        gen = proxy._call("decode", "/v1/completions", {}, "id", "r1", 12)
        assert await gen.__anext__() == {"replica": "r1", "status": 200}
        assert streams[0].counted_before_its_answer == 12      # counted from the pick on
        assert proxy.blocks_in_flight["decode"]["r1"] == 12 and proxy.ongoing["decode"]["r1"] == 1
        assert [x async for x in gen] == [b"a", b"b"]          # the stream ends: not counted
        assert proxy.blocks_in_flight["decode"]["r1"] == 0 and proxy.ongoing["decode"]["r1"] == 0
        gen = proxy._call("decode", "/v1/completions", {}, "id", None, 5)   # no pick: the
        await gen.__anext__()                                   # replica that answers
        assert proxy.blocks_in_flight["decode"]["r9"] == 5
        await gen.aclose()                                      # the client went away
        assert proxy.blocks_in_flight["decode"]["r9"] == 0 and streams[-1].cancelled
    asyncio.run(run())


def test_the_routing_figure_draws_the_best_hit_rate_per_turn_and_no_router_above_it():
    """Notebook 06's figure of figures/fleet_multiturn.json: the ideal (one engine holding every
    earlier turn) is drawn per turn, not as one average over all turns, and agrees with the
    saved run's totals; at no turn does a router's hit rate rise above it."""
    pytest.importorskip("matplotlib")
    import json
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minivllm.bench.fleet_multiturn import IDEAL_LABEL, plot_multiturn
    path = os.path.join(os.path.dirname(__file__), "..", "figures", "fleet_multiturn.json")
    with open(path) as f:
        result = json.load(f)
    ideal, tokens = result["ideal_hit_rate_per_turn"], result["ideal_prompt_tokens_per_turn"]
    assert sum(h * n for h, n in zip(ideal, tokens)) / sum(tokens) == pytest.approx(
        result["ideal_hit_rate"], abs=1e-12)
    assert all(row["prompt_tokens"] == sum(tokens) for row in result["table"].values())
    fig = plot_multiturn(result)
    try:
        drawn = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].get_lines()}
    finally:
        plt.close(fig)
    best = drawn.pop(IDEAL_LABEL)
    assert best == [100 * h for h in ideal] and len(set(best)) == len(best)
    assert set(drawn) == set(result["table"])
    for router, rates in drawn.items():
        assert len(rates) == len(best)
        assert all(r <= b + 1e-9 for r, b in zip(rates, best)), (router, rates, best)
