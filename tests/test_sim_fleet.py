"""The fleet in virtual time (minivllm/sim/fleet.py) and the planner (minivllm/sim/plan.py): the
router is the fleet's own (disagg/fleet/kv_index.py, fed by the simulated engines' KV events), the
P/D decision is decode-first, P/D requests pay the KV transfer, colocated serving runs on the same
simulator, the planner finds a plan known by construction, and ``sim fleet`` / ``sim plan`` write
what DESIGN.md 5.8 says."""
from __future__ import annotations

import json

import pytest

from minivllm.disagg.fleet.kv_index import prompt_block_hashes
from minivllm.distributed.kv_events import BlockStored
from minivllm.sim import plan
from minivllm.sim import trace as traces
from minivllm.sim.cost_model import CostModel
from minivllm.sim.engine import make_vllm_config
from minivllm.sim.fleet import SimFleet, SimFleetConfig, run_fleet, slo_attainment
from minivllm.sim.trace import TraceRequest
from minivllm.sim.transfer import TRANSFER_COSTS, TransferCost

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 4
COST = CostModel(step_s=0.01, prefill_token_s=1e-3, decode_token_s=1e-3)
FREE = TRANSFER_COSTS["free"]


@pytest.fixture(scope="module")
def vllm_config(tiny_llama_dir):
    return make_vllm_config(tiny_llama_dir, block_size=BS)


def _run(vllm_config, requests, cost=COST, **fleet):
    fleet.setdefault("transfer", FREE)
    sim = SimFleet(SimFleetConfig(**fleet), vllm_config, cost)
    return sim, sim.run(requests)


def _by_id(records):
    return {r.request_id: r for r in records}


# ---------------------------------------------------------------------- the router
def test_multiturn_turns_go_to_the_decode_replica_holding_the_conversation(vllm_config):
    """Two chats of four turns on 2P3D: the first turn is prefilled remotely; every later turn
    goes to the decode replica that holds the chat (the pool's KVIndex, fed only by the engines'
    BlockStored / BlockRemoved events), which computes the new message itself."""
    requests = traces.multiturn_trace(2, 4, 16, vocab_size=256)
    sim, records = _run(vllm_config, requests, num_prefill=2, num_decode=3,
                        pd_min_uncached_tokens=16, record_routes=True)
    assert len(records) == 8 and all(r.num_output_tokens == 16 for r in records)
    routes = {r["request_id"]: r for r in sim.ingress.routes}
    conv_of = {r.request_id: r.conversation for r in requests}
    for conv in ("0", "1"):
        turns = [routes[r.request_id] for r in requests if r.conversation == conv]
        first, later = turns[0], turns[1:]
        assert first["remote_prefill"] and first["cached_blocks"] == 0
        assert {t["pick"] for t in later} == {first["pick"]}
        for turn, req in zip(later, [r for r in requests if r.conversation == conv][:-1]):
            # The previous turn's prompt and its reply (all but the last token) are held.
            assert turn["cached_blocks"] == (req.prompt_tokens + 16 - 1) // BS
            assert not turn["remote_prefill"]
    assert sim.ingress.num_remote_prefills == 2 and sim.stats()["kv_pulls"] == 2
    # The index was built from events alone: the picks' blocks are in it, the idle one's not.
    index = sim.ingress.index["decode"]
    picks = {routes[rid]["pick"] for rid in conv_of}
    assert len(picks) == 2 and all(index.num_blocks(p) > 0 for p in picks)
    (idle,) = set(sim.replica_names["decode"]) - picks
    assert index.num_blocks(idle) == 0
    # Round robin ignores the index: later turns land elsewhere and go remote again.
    rr, rr_records = _run(vllm_config, requests, num_prefill=2, num_decode=3,
                          pd_min_uncached_tokens=16, router="round_robin")
    assert len(rr_records) == 8 and rr.ingress.num_remote_prefills > 2


def test_lost_or_stale_events_cost_a_miss_never_a_failure(vllm_config):
    """Every KV event batch lost: no turn finds its chat, each is prefilled remotely, and every
    request still finishes with its tokens. A stale index (a replica said to hold a prompt it
    never saw): the router sends the prompt there without a remote prefill, and that replica
    computes it itself."""
    requests = traces.multiturn_trace(2, 3, 16, vocab_size=256)
    sim, records = _run(vllm_config, requests, num_prefill=1, num_decode=2,
                        pd_min_uncached_tokens=16, kv_event_loss=1.0, record_routes=True)
    assert [r.num_output_tokens for r in records] == [16] * 6
    assert all(r["cached_blocks"] == 0 and r["remote_prefill"] for r in sim.ingress.routes)
    assert sim.stats()["kv_event_batches_lost"] > 0
    late, late_records = _run(vllm_config, requests, num_prefill=1, num_decode=2,
                              pd_min_uncached_tokens=16, kv_event_delay_s=30.0)
    assert [r.num_output_tokens for r in late_records] == [16] * 6

    prompt = list(range(40, 80))
    stale = SimFleet(SimFleetConfig(num_prefill=1, num_decode=2, transfer=FREE,
                                    pd_min_uncached_tokens=16, record_routes=True),
                     vllm_config, COST)
    hashes = prompt_block_hashes(prompt, BS)
    stale.ingress.index["decode"].apply("decode-01", [BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=prompt, block_size=BS,
        lora_id=None, medium="GPU", lora_name=None)])
    (rec,) = stale.run([TraceRequest("x", 0.0, len(prompt), 8, prompt)])
    route = stale.ingress.routes[0]
    assert route["pick"] == "decode-01" and route["cached_blocks"] == 10
    assert not route["remote_prefill"] and rec.num_output_tokens == 8
    assert stale.stats()["prefill_steps"] == 0
    # It paid for the whole prompt: one step of 40 prefill tokens.
    assert rec.ttft_s == pytest.approx(COST.step_s + 40 * COST.prefill_token_s)


def test_decode_first_skips_the_prefill_replica_when_decode_holds_the_prompt(vllm_config):
    """1P1D: a prompt is prefilled remotely; the same prompt again, once the first is done, finds
    the decode replica holding it (pulled blocks are cached there) and never reaches prefill."""
    prompt = list(range(40, 100))
    requests = [TraceRequest("a", 0.0, len(prompt), 8, prompt),
                TraceRequest("b", 10.0, len(prompt), 8, list(prompt))]
    sim, records = _run(vllm_config, requests, num_prefill=1, num_decode=1, record_routes=True,
                        pd_min_uncached_tokens=16)
    a, b = sim.ingress.routes
    assert a["remote_prefill"] and a["prefill"]["pick"] == "prefill-00"
    assert not b["remote_prefill"] and b["prefill"] is None
    assert b["cached_blocks"] == len(prompt) // BS        # pulled, then cached by decode
    # Prefill worked once: one step of the 60-token prompt (its other steps empty: holding).
    prefill = sim.replicas["prefill"]["prefill-00"]
    assert prefill.busy_s == pytest.approx(COST.step_s + len(prompt) * COST.prefill_token_s)
    ra, rb = _by_id(records)["a"], _by_id(records)["b"]
    assert rb.ttft_s < ra.ttft_s and rb.prefill is None


def test_pd_ttft_includes_the_transfer(vllm_config):
    """One request on 1P1D: TTFT = P's prefill step + the pull (latency + bytes / bandwidth, the
    bytes the prompt's blocks hold: layers x 2 x KV heads x head dim x 4 bytes per token) + D's
    step computing the last prompt token; exactly the pull's time more than a free transfer."""
    L = 40
    req = [TraceRequest("r", 0.0, L, 4, list(range(50, 50 + L)))]
    cost = TransferCost(1e6, 0.05)
    slow, (rec,) = _run(vllm_config, req, num_prefill=1, num_decode=1, transfer=cost,
                        pd_min_uncached_tokens=0)
    free, (rec0,) = _run(vllm_config, req, num_prefill=1, num_decode=1, pd_min_uncached_tokens=0)
    bytes_per_token = 2 * 2 * 4 * 16 * 4           # the tiny Llama in float32
    pull = cost.time_s(-(-L // BS) * BS * bytes_per_token)
    prefill = COST.step_s + L * COST.prefill_token_s
    first = COST.step_s + COST.decode_token_s      # D recomputes the last prompt token
    assert rec.ttft_s == pytest.approx(prefill + pull + first)
    assert rec.ttft_s - rec0.ttft_s == pytest.approx(pull)
    assert slow.hub.bytes_moved == -(-L // BS) * BS * bytes_per_token
    assert not slow.hub.held                       # D's done freed P's blocks
    assert not slow.replicas["prefill"]["prefill-00"].engine.scheduler.requests


def test_colocated_and_pd_on_the_same_trace(vllm_config):
    """The same Poisson trace through two colocated engines and through 1P1D: all requests done
    on both; colocated moves no KV; its decodes share steps with prefills (a higher ITL), P/D's
    decode replica never runs a long prefill (a lower ITL) but pays the transfer."""
    requests = traces.poisson_trace(30, 3.0, (64, 160), (16, 48), seed=1)
    cost = CostModel(step_s=0.01, prefill_token_s=2e-3, decode_token_s=5e-4)
    colo, colo_records = _run(vllm_config, requests, cost, num_colocated=2)
    pd, pd_records = _run(vllm_config, requests, cost, num_prefill=1, num_decode=1,
                          transfer=TRANSFER_COSTS["zmq_pull"])
    assert [r.request_id for r in colo_records] == [r.request_id for r in pd_records] == \
        [r.request_id for r in requests]
    assert [r.num_output_tokens for r in colo_records] == [r.output_tokens for r in requests]
    assert [r.num_output_tokens for r in pd_records] == [r.output_tokens for r in requests]
    assert "kv_pulls" not in colo.stats() and pd.stats()["kv_pulls"] == 30
    s_colo, s_pd = (plan_summary(colo_records), plan_summary(pd_records))
    assert s_pd["itl_p90_s"] < s_colo["itl_p90_s"]
    assert s_pd["ttft_p50_s"] > s_colo["ttft_p50_s"]


def plan_summary(records):
    from minivllm.sim.fleet import summarize_records
    return summarize_records(records)


# ---------------------------------------------------------------------- the planner
def test_planner_finds_the_plan_known_by_construction(vllm_config):
    """A cost model where the answer is known: a prefill costs a * L (L = 128 tokens), a decode
    step b whatever its batch, the transfer nothing; arrivals evenly spaced; ITL target 1.5 b.

    - P/D with x prefill replicas: decode never waits on a prefill (ITL = b), prefill serves
      1 / (aL) per replica, so goodput = x / (aL): per instance x / ((x + y) aL).
    - Colocated: a prefill sharing a step with a decode adds aL to it; a request of 64 tokens
      whose decode meets two prefills is over 1.5 b, so colocated falls behind 1P1D.
    The best unit is 2P1D (2 / (3 aL) per instance), and the planner says so."""
    a, b, L, out = 2e-3, 1e-2, 128, 64
    cost = CostModel(step_s=b, prefill_token_s=a)
    requests = [TraceRequest(str(i), i / 2.0, L, out) for i in range(40)]
    slo = plan.SLO(ttft_s=1.0, itl_s=1.5 * b)
    base = SimFleetConfig(transfer=FREE)
    counts = [{"num_colocated": 1}, {"num_prefill": 1, "num_decode": 1},
              {"num_prefill": 2, "num_decode": 1}, {"num_prefill": 1, "num_decode": 2}]
    rows = {r.label: r for r in plan.search(requests, slo, base, vllm_config, cost, counts)}
    aL = a * L
    # Within the search's precision and the slack a finite trace leaves above capacity.
    assert rows["1P1D"].goodput_per_instance == pytest.approx(1 / (2 * aL), rel=0.12)
    assert rows["2P1D"].goodput_per_instance == pytest.approx(2 / (3 * aL), rel=0.12)
    assert rows["1P2D"].goodput_per_instance == pytest.approx(1 / (3 * aL), rel=0.12)
    assert rows["colocated x1"].goodput_per_instance < rows["1P1D"].goodput_per_instance
    p = plan.make_plan(list(rows.values()), rate=20.0, slo=slo, cost_model=cost,
                       requests=requests, fleet_config=base, model="M", max_num_seqs=128,
                       bytes_per_token=1024)
    assert p.best.label == "2P1D"
    assert p.copies == -(-20.0 // rows["2P1D"].rate)
    assert f"--prefill 1:{2 * p.copies} --decode 1:{p.copies}" in p.command
    assert p.command.startswith("python -m minivllm.disagg.fleet ")


def test_autoscaling_targets_come_from_the_cost_model():
    """--decode-target-running: the largest batch whose step stays within the ITL target;
    --prefill-target-queued-tokens: the tokens one prefill replica clears within what the TTFT
    target leaves after the transfer and decode's first step."""
    cost = CostModel(step_s=0.01, prefill_token_s=1e-3, decode_token_s=2e-3)
    slo = plan.SLO(ttft_s=1.0, itl_s=0.05)
    t = plan.autoscale_targets(cost, slo, mean_prompt=200, mean_output=100, transfer_s=0.1,
                               max_num_seqs=128)
    assert t.decode_target_running == 20               # 0.01 + 20 * 0.002 = 0.05
    budget = 1.0 - 0.1 - (0.01 + 0.002)
    assert t.prefill_target_queued_tokens == int(200 / (0.01 + 0.2) * budget)
    assert "--decode-target-running 20" in t.how[1]


def test_goodput_search_brackets_then_bisects():
    """Doubling to a bracket, then bisection to the tolerance, on a step function."""
    seen = []

    def simulate(rate):
        seen.append(rate)
        return plan.Trial(rate, 1.0 if rate <= 7.3 else 0.5, {})
    rate, trial, trials = plan.goodput(simulate, 1.0, plan.SLO(1, 1), rel_tol=0.01)
    assert 7.3 / 1.01 <= rate <= 7.3 and trial.rate == rate and seen[:4] == [1, 2, 4, 8]
    rate, trial, _ = plan.goodput(lambda r: plan.Trial(r, 0.0, {}), 1.0, plan.SLO(1, 1))
    assert rate == 0.0 and trial is None


# ---------------------------------------------------------------------- the commands
def test_sim_fleet_writes_the_documented_lines(tiny_llama_dir, tmp_path, capsys):
    """``sim fleet``: one line per request with DESIGN.md 5.8's keys, in trace order, then
    ``SUMMARY`` with the summary's keys (and the fleet's counts); P/D and colocated; no cost
    model: exit 2 with the command that makes one."""
    from minivllm.sim.__main__ import main
    requests = traces.poisson_trace(10, 4.0, (8, 60), (2, 20), seed=3)
    trace = traces.write_trace(str(tmp_path / "t.jsonl"), requests)
    cost = COST.save(str(tmp_path / "cost.json"))
    for shape in (["--prefill", "1", "--decode", "2"], ["--colocated", "2"]):
        out = tmp_path / "out.jsonl"
        assert main(["fleet", "--trace", trace, *shape, "--model", tiny_llama_dir,
                     "--cost-model", cost, "--block-size", "4", "--out", str(out),
                     "--ttft-p90", "1.0", "--itl-p90", "0.1"]) == 0
        lines = out.read_text().splitlines()
        assert len(lines) == 11 and lines[-1].startswith("SUMMARY ")
        rows = [json.loads(ln) for ln in lines[:-1]]
        assert all(set(r) == {"request_id", "ttft_s", "itl_s", "e2e_s"} for r in rows)
        assert [r["request_id"] for r in rows] == [str(i) for i in range(10)]
        assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in rows)
        summary = json.loads(lines[-1][len("SUMMARY "):])
        assert {"ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "makespan_s",
                "num_requests"} <= set(summary) and summary["num_requests"] == 10
        assert 0.0 <= summary["slo_attainment"] <= 1.0
    err = capsys.readouterr().err
    assert "ms per request" in err and "peak RSS" in err
    assert main(["fleet", "--trace", trace, "--colocated", "1", "--model", "some/model"]) == 2
    assert "sim profile --model some/model" in capsys.readouterr().err


def test_sim_plan_prints_table_plan_and_command(tiny_llama_dir, tmp_path, capsys):
    from minivllm.sim.__main__ import main
    cost = CostModel(step_s=0.01, prefill_token_s=1e-3, decode_token_s=1e-4).save(
        str(tmp_path / "cost.json"))
    assert main(["plan", "--workload", "poisson", "--num-requests", "30", "--request-rate", "2",
                 "--prompt-tokens", "32,96", "--output-tokens", "8,24", "--ttft-p90", "0.5",
                 "--itl-p90", "0.02", "--max-instances", "2", "--model", tiny_llama_dir,
                 "--cost-model", cost, "--block-size", "4", "--transfer", "12.5:0.05"]) == 0
    out = capsys.readouterr().out
    assert "| fleet | instances | goodput req/s |" in out
    assert "| colocated x1 |" in out and "| 1P1D |" in out and "| colocated x2 |" in out
    assert "PLAN: " in out and "COMMAND: " in out
    best = json.loads(out.split("\nPLAN ", 1)[1].splitlines()[0])
    assert best["copies"] >= 1 and best["best"]["goodput_rps"] > 0


# ---------------------------------------------------------------------- scale
def test_scale_smoke_memory_stays_flat(vllm_config):
    """A small fleet (4P6D) through a streamed Poisson trace: every request done, and nothing of a
    finished request is kept (no flight, no engine times, no held blocks, no pending pull)."""
    from minivllm.sim.cli_fleet import iter_poisson
    stream = iter_poisson(400, 40.0, (16, 128), (8, 64), seed=2)
    assert iter(stream) is stream                       # a generator, not a list
    records, summary = run_fleet(SimFleetConfig(num_prefill=4, num_decode=6, transfer=FREE),
                                 vllm_config, COST, stream)
    assert summary["num_requests"] == 400 and len(records) == 400
    assert summary["sim_wall_ms_per_request"] > 0
    assert [r.request_id for r in records] == [str(i) for i in range(400)]
    assert [r.request_id for r in records] == \
        [r.request_id for r in traces.poisson_trace(400, 40.0, (16, 128), (8, 64), seed=2)]
    assert slo_attainment(records, 1e9, 1e9) == 1.0


def test_a_finished_fleet_keeps_nothing_per_request(vllm_config):
    requests = traces.poisson_trace(40, 20.0, (16, 100), (4, 30), seed=4)
    sim, records = _run(vllm_config, requests, num_prefill=2, num_decode=2)
    assert len(records) == 40 and not sim.flights and not sim.hub.held
    for replicas in sim.replicas.values():
        for r in replicas.values():
            assert not r.engine.times and not r.engine.scheduler.requests


def test_contention_is_one_unless_asked(tiny_llama_dir, tmp_path, capsys):
    """A fleet's replicas run on machines of their own: the cost model's contention (measured on
    this shared machine) applies only with ``--contention profile``, or as given."""
    import dataclasses

    from minivllm.sim.__main__ import main
    trace = traces.write_trace(str(tmp_path / "t.jsonl"),
                               traces.poisson_trace(6, 2.0, (8, 40), (2, 8), seed=1))
    cost = dataclasses.replace(COST, contention=3.0).save(str(tmp_path / "cost.json"))
    ttft = {}
    for flag in ("1", "profile", "2"):
        out = tmp_path / f"{flag}.jsonl"
        assert main(["fleet", "--trace", trace, "--colocated", "1", "--model", tiny_llama_dir,
                     "--cost-model", cost, "--block-size", "4", "--contention", flag,
                     "--out", str(out)]) == 0
        first = json.loads(out.read_text().splitlines()[0])
        ttft[flag] = first["ttft_s"]
    n = traces.poisson_trace(6, 2.0, (8, 40), (2, 8), seed=1)[0].prompt_tokens
    alone = COST.step_s + n * COST.prefill_token_s           # the first request finds it idle
    assert ttft["1"] == pytest.approx(alone) and ttft["profile"] == pytest.approx(3 * alone)
    assert ttft["2"] == pytest.approx(2 * alone)
    assert "the profile measured 3 here" in capsys.readouterr().err
    assert main(["fleet", "--trace", trace, "--colocated", "1", "--model", tiny_llama_dir,
                 "--cost-model", cost, "--contention", "0"]) == 2
