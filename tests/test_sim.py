"""The simulator (minivllm/sim/): the simulated engine schedules exactly what the real engine
schedules, step for step (chunked prefill, preemption, the prefix cache, speculative decoding with
the real run's acceptance replayed); the cost model's fit, file and missing-file message;
``sim run``'s lines; traces and their generators; the engine's own KV events for a fleet's index."""
from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from conftest import tiny_llm
from minivllm import SamplingParams
from minivllm.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.sim import trace as traces
from minivllm.sim.cost_model import (COEFFICIENTS, Acceptance, CostModel, CostModelMissing,
                                     StepShape, default_path)
from minivllm.sim.engine import SimEngine, summarize
from minivllm.sim.profile import PROFILING_WORKER

pytestmark = pytest.mark.usefixtures("one_thread")

COST = CostModel(step_s=0.02, prefill_token_s=2e-4, decode_token_s=1e-3, draft_token_s=5e-4,
                 prefill_attn_s=1e-7, decode_attn_s=2e-6, drafter_step_s=3e-3, drafter_req_s=1e-4)
SPECS = {"plain": None,
         "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                   "prompt_lookup_max": 3},
         "draft_model": {"method": "draft_model", "num_speculative_tokens": 2,
                         "draft_num_layers": 1}}
# A token budget of 32 chunks every prompt; 48 blocks of 4 tokens cannot hold eight requests.
ENGINE = dict(max_num_batched_tokens=32, num_gpu_blocks_override=48, max_num_seqs=8)


def _workload(spec: bool) -> list[tuple[int, str, list[int], int]]:
    """(step it arrives before, id, prompt, output tokens): staggered, some sharing a 24-token
    prefix (prefix-cache hits); with speculation, prompts repeating a pattern (n-gram finds
    drafts and the tiny model goes on repeating it)."""
    rng = np.random.default_rng(0)
    base = rng.integers(32, 256, 40).tolist()
    pattern = rng.integers(32, 256, 6).tolist()
    out = []
    for i in range(8):
        if i % 3 == 0:
            prompt = base[:24] + rng.integers(32, 256, int(rng.integers(8, 40))).tolist()
        elif spec:
            prompt = (pattern * 12)[:int(rng.integers(20, 60))]
        else:
            prompt = rng.integers(32, 256, int(rng.integers(20, 70))).tolist()
        out.append((2 * i, str(i), prompt, int(rng.integers(8, 30))))
    return out


def _step_view(scheduler, so: SchedulerOutput, outputs: dict[str, int]) -> dict:
    """What the scheduler decided in a step: tokens per request, drafts, preemptions, the block
    ids handed to the worker, every running request's block table after it, and each request's
    output tokens so far."""
    manager = scheduler.kv_cache_manager
    cached = so.scheduled_cached_reqs
    return {"num_scheduled_tokens": dict(so.num_scheduled_tokens),
            "drafts": {r: len(d) for r, d in so.scheduled_spec_decode_tokens.items()},
            "preempted": sorted(so.preempted_req_ids),
            "new_blocks": {**{r.req_id: r.block_ids for r in so.scheduled_new_reqs},
                           **dict(zip(cached.req_ids, cached.new_block_ids))},
            "block_tables": {r.request_id: manager.get_blocks(r.request_id).get_block_ids()
                             for r in scheduler.running},
            "outputs": dict(outputs)}


@pytest.mark.parametrize("method", sorted(SPECS))
def test_scheduling_decisions_are_the_real_ones(tiny_llama_dir, method):
    """The same trace through the real engine (tiny random model, its worker recording) and the
    simulated one (its drafting replayed from the real run): every step schedules the same tokens
    and drafts, preempts the same requests and allocates the same blocks."""
    spec = SPECS[method]
    work = _workload(spec is not None)
    llm = tiny_llm(tiny_llama_dir, spec, worker_cls=PROFILING_WORKER, **ENGINE)
    engine, worker = llm.llm_engine, llm.llm_engine.engine_core.worker
    real, pending, produced = [], list(work), {}
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= len(real):
            _, rid, prompt, n = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": prompt},
                               SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
        real.append(_step_view(engine.scheduler, worker.records[-1].scheduler_output, produced))
    cached_hits = engine.scheduler.kv_cache_manager.prefix_cache_stats.hits

    sim = SimEngine.from_engine_args(tiny_llama_dir, COST,
                                     worker.replayed_drafts() if spec else None,
                                     block_size=4, speculative_config=spec, **ENGINE)
    simulated, pending = [], list(work)
    while pending or sim.has_unfinished_requests():
        while pending and pending[0][0] <= len(simulated):
            _, rid, prompt, n = pending.pop(0)
            sim.add_request(rid, prompt, n)
        result = sim.step()
        simulated.append(_step_view(sim.scheduler, result.scheduler_output,
                                    {r: t.num_output_tokens for r, t in sim.times.items()
                                     if t.num_output_tokens}))
    assert len(simulated) == len(real)
    for i, (a, b) in enumerate(zip(real, simulated)):
        assert a == b, f"step {i} differs"
    # The configuration is LLM's for the same arguments (make_vllm_config mirrors it).
    for name in ("model_config", "cache_config", "scheduler_config", "speculative_config"):
        assert getattr(sim.vllm_config, name) == getattr(llm.vllm_config, name), name
    # The trace exercised what it is meant to.
    assert sum(len(s["preempted"]) for s in real) >= 1
    records = worker.records
    assert any(r.shape.num_prefill_reqs and not all(r.num_sampled.values()) for r in records)
    assert cached_hits > 0 and sim.scheduler.kv_cache_manager.prefix_cache_stats.hits == cached_hits
    assert all(t.num_output_tokens == n for (_, rid, _, n), t in
               zip(work, (sim.times[w[1]] for w in work)))
    if spec:
        verified = [(len(r.scheduler_output.scheduled_spec_decode_tokens[q]), a)
                    for r in records for q, a in r.drafts.accepted.items()]
        assert sum(n for n, _ in verified) > 20 and sum(a for _, a in verified) > 0
        if method == "draft_model":
            assert any(a < n for n, a in verified)   # some drafts rejected too


@pytest.mark.parametrize("method", ["plain", "draft_model"])
def test_kv_cache_size_without_override_is_the_workers(tiny_llama_dir, method):
    """Without ``num_gpu_blocks_override`` the simulated worker sizes the KV cache as the real one
    does (its budget over the bytes of a block, the self-draft's layers included), without
    a model."""
    llm = tiny_llm(tiny_llama_dir, SPECS[method])
    cost = dataclasses.replace(COST, acceptance=Acceptance("draft_model", 2, [1, 1, 1]))
    sim = SimEngine.from_engine_args(tiny_llama_dir, cost, block_size=4,
                                     speculative_config=SPECS[method])
    blocks = sim.vllm_config.cache_config.num_gpu_blocks
    assert blocks == llm.vllm_config.cache_config.num_gpu_blocks


# ---------------------------------------------------------------------- the cost model
def _random_shapes(n: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    shapes = []
    for _ in range(n):
        n_pre, n_dec = rng.choice([(1, 0), (0, rng.randint(1, 32)), (1, rng.randint(1, 16))])
        q = [rng.randint(2, 1024) for _ in range(n_pre)]
        c = [rng.randint(0, 2048) for _ in range(n_pre + n_dec)]
        spec = rng.random() < 0.5 and n_dec > 0
        drafts = [rng.randint(0, 3) if spec else 0 for _ in range(n_dec)]
        shapes.append(StepShape(
            num_reqs=n_pre + n_dec, num_prefill_reqs=n_pre, num_decode_reqs=n_dec,
            num_prefill_tokens=sum(q), num_decode_tokens=n_dec, num_draft_tokens=sum(drafts),
            prefill_context_sum=sum(qi * ci + qi * (qi + 1) // 2 for qi, ci in zip(q, c)),
            decode_context_sum=sum(ci + 1 + d for ci, d in zip(c[n_pre:], drafts)),
            num_sampled_reqs=n_pre + n_dec, num_drafting_reqs=n_pre + n_dec if spec else 0))
    return shapes


@pytest.mark.parametrize("solver", ["scipy", "numpy"])
def test_fit_recovers_known_coefficients(solver, monkeypatch):
    """Steps timed by a known model: the fit gives its coefficients back (exactly without noise;
    within a few percent with 2% noise), with SciPy's NNLS and with the numpy fallback."""
    if solver == "numpy":
        monkeypatch.setitem(__import__("sys").modules, "scipy.optimize", None)
    shapes = _random_shapes(400)
    exact = CostModel.fit([(s, COST.predict(s)) for s in shapes])
    for name in COEFFICIENTS:
        assert getattr(exact, name) == pytest.approx(getattr(COST, name), rel=1e-6), name
    rng = np.random.default_rng(1)
    noisy = CostModel.fit([(s, COST.predict(s) * (1 + 0.02 * rng.standard_normal()))
                           for s in shapes])
    for name in ("step_s", "prefill_token_s", "decode_token_s", "decode_attn_s"):
        assert getattr(noisy, name) == pytest.approx(getattr(COST, name), rel=0.1), name
    assert all(e["abs_rel_err_mean"] < 0.03 for e in noisy.meta["fit_error"].values())


def test_fit_keeps_coefficients_non_negative_and_names_unexercised_terms():
    """A term pulled negative by the data is held at 0; terms no step exercises (no drafting)
    stay 0 and are named."""
    shapes = [s for s in _random_shapes(200) if not s.num_drafting_reqs and not s.num_draft_tokens]
    # Time falls with the decode context: a negative decode_attn_s would fit it best.
    samples = [(s, 0.05 + 1e-3 * s.num_decode_tokens - 1e-7 * s.decode_context_sum + 0.02)
               for s in shapes]
    model = CostModel.fit(samples)
    assert min(model.coefficients.values()) >= 0
    assert set(model.meta["unfitted"]) == {"draft_token_s", "drafter_step_s", "drafter_req_s"}


def test_step_shape_from_a_scheduler_output():
    """A new request's last prompt chunk, a running request's middle chunk, a decode with 2
    drafts: the shape's counts, by hand."""
    so = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", list(range(20)), SamplingParams(), ([1],), 8)],
        scheduled_cached_reqs=CachedRequestData(req_ids=["b", "c"], new_block_ids=[None, None],
                                                num_computed_tokens=[16, 40],
                                                num_output_tokens=[0, 5]),
        num_scheduled_tokens={"a": 12, "b": 10, "c": 3}, total_num_scheduled_tokens=25,
        scheduled_spec_decode_tokens={"c": [7, 8]}, num_common_prefix_blocks=[0],
        finished_req_ids=set())
    shape = StepShape.from_scheduler_output(so, {"a": 20, "b": 64, "c": 41}, speculating=True)
    assert shape == StepShape(
        num_reqs=3, num_prefill_reqs=2, num_decode_reqs=1, num_prefill_tokens=22,
        num_decode_tokens=1, num_draft_tokens=2,
        prefill_context_sum=12 * 8 + 12 * 13 // 2 + 10 * 16 + 10 * 11 // 2,
        decode_context_sum=40 + 1 + 2, num_sampled_reqs=2, num_drafting_reqs=2)
    assert shape.shape_class == "mixed+spec"
    assert COST.predict(StepShape()) == 0.0


def test_acceptance_is_measured_per_position_and_drawn_by_it():
    """Per-position rates from every verify, short ones too: r1 = 3/4, r2 = 2/3, r3 = 1/1, so
    P(accepted = 0..3) = 1/4, 1/4, 0, 1/2; ``MeasuredDrafts`` draws by it (seeded), capped by the
    drafts proposed."""
    from minivllm.sim.worker import MeasuredDrafts
    acc = Acceptance.measure("ngram", 3, [(3, 3), (3, 0), (2, 2), (3, 1)], num_sampling=10,
                             num_proposing=4)
    assert acc.accepted_length_probs == pytest.approx([0.25, 0.25, 0.0, 0.5])
    assert acc.draft_probability == 0.4 and acc.mean_accepted == pytest.approx(1.75)
    drafts = MeasuredDrafts(acc, seed=0)
    draws = [drafts.num_accepted(0, "r", 3) for _ in range(20000)]
    assert np.bincount(draws, minlength=4) / 20000 == pytest.approx([0.25, 0.25, 0, 0.5], abs=0.015)
    assert max(drafts.num_accepted(0, "r", 1) for _ in range(100)) == 1
    proposed = [drafts.num_drafts(0, "r", 3) for _ in range(20000)]
    assert set(proposed) == {0, 3} and np.mean(proposed) / 3 == pytest.approx(0.4, abs=0.015)
    assert MeasuredDrafts(acc, 1).num_accepted(0, "r", 3) == MeasuredDrafts(acc, 1).num_accepted(
        0, "r", 3)


def test_profile_times_real_steps_and_fits(tiny_llama_dir):
    """``profile`` on the tiny model (one round, its lengths scaled to the model): every timed
    step is a real one with its shape, the fit covers prefill, decode and mixed steps with and
    without speculation, and the acceptance comes from the speculative engine's verifies."""
    from minivllm.sim.profile import profile
    cost, samples = profile(tiny_llama_dir, minutes=1e-4, progress=False)
    classes = set(cost.meta["fit_error"])
    assert {"prefill", "decode", "mixed", "decode+spec"} <= classes
    assert set(cost.meta["wall_error"]) == classes and cost.meta["fitted_to"] == "thread CPU time"
    assert len(samples) == cost.meta["num_samples"] > 100
    assert all(wall > 0 and cpu > 0 and s.num_reqs for s, wall, cpu in samples)
    assert min(cost.coefficients.values()) >= 0 and cost.step_s > 0
    ratios = sorted(wall / cpu for _, wall, cpu in samples)
    assert cost.contention == pytest.approx(float(np.median(ratios)))
    assert cost.acceptance is not None and cost.acceptance.num_observed > 0
    assert cost.meta["rounds"] == 1 and cost.meta["torch"] and cost.meta["date"]


def test_cost_model_file_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    path = default_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert path == str(tmp_path / "sim" / "HuggingFaceTB--SmolLM2-135M-Instruct.json")
    model = dataclasses.replace(COST, contention=1.4,
                                meta={"machine": "here", "model": "m", "torch": "2",
                                      "date": "2026-01-01"},
                                acceptance=Acceptance("ngram", 3, [1, 1, 0, 2], 0.5, 4))
    loaded = CostModel.load(model.save(path))
    assert loaded == model
    shapes = _random_shapes(20)
    assert [loaded.predict(s) for s in shapes] == [model.predict(s) for s in shapes]
    assert loaded.predict(shapes[0]) == pytest.approx(1.4 * COST.predict(shapes[0]))
    assert loaded.acceptance.accepted_length_probs == [0.25, 0.25, 0.0, 0.5]


def test_a_missing_cost_model_says_how_to_make_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE_DIR", str(tmp_path))
    with pytest.raises(CostModelMissing, match=r"python -m minivllm.sim profile --model M"):
        CostModel.load(str(tmp_path / "none.json"), "M")
    from minivllm.sim.__main__ import main
    trace = traces.write_trace(str(tmp_path / "t.jsonl"), traces.poisson_trace(3, 1.0))
    assert main(["run", "--trace", trace, "--model", "some/model"]) == 2
    err = capsys.readouterr().err
    assert "No cost model at" in err and "sim profile --model some/model" in err


# ---------------------------------------------------------------------- sim run
def test_sim_run_writes_the_documented_lines(tiny_llama_dir, tmp_path):
    """``sim run``: one line per request with exactly DESIGN.md 5.8's keys, then ``SUMMARY``;
    no request's first token comes before its arrival, and one arriving at an idle engine is
    answered after exactly its prefill step's time."""
    from minivllm.sim.__main__ import main
    requests = traces.poisson_trace(12, 4.0, (8, 60), (2, 20), seed=3)
    requests[-1].arrival_s += 100.0     # long after the others: the engine is idle
    trace = traces.write_trace(str(tmp_path / "t.jsonl"), requests)
    cost = COST.save(str(tmp_path / "cost.json"))
    out = tmp_path / "out.jsonl"
    assert main(["run", "--trace", trace, "--model", tiny_llama_dir, "--cost-model", cost,
                 "--block-size", "4", "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 13 and lines[-1].startswith("SUMMARY ")
    rows = [json.loads(ln) for ln in lines[:-1]]
    assert all(set(r) == {"request_id", "ttft_s", "itl_s", "e2e_s"} for r in rows)
    assert [r["request_id"] for r in rows] == [str(i) for i in range(12)]
    assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in rows)
    summary = json.loads(lines[-1][len("SUMMARY "):])
    assert set(summary) == {"ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "makespan_s",
                            "num_requests"}
    assert summary["num_requests"] == 12 and summary["makespan_s"] > 100.0
    last = requests[-1]
    n = last.prompt_tokens
    assert rows[-1]["ttft_s"] == pytest.approx(COST.step_s + COST.prefill_token_s * n
                                               + COST.prefill_attn_s * (n * (n + 1) // 2))


def test_arrivals_are_respected(tiny_llama_dir):
    """Through ``run_trace``: every first token at or after its arrival, tokens in order, the
    summary over all requests; a busy engine cannot idle forward."""
    sim = SimEngine.from_engine_args(tiny_llama_dir, COST, block_size=4, max_num_seqs=4)
    requests = traces.poisson_trace(30, 20.0, (8, 100), (1, 30), seed=5)
    times = sim.run_trace(requests)
    for r, t in zip(requests, times):
        assert t.arrival_s == r.arrival_s and t.first_token_s > t.arrival_s
        assert t.num_output_tokens == r.output_tokens == len(t.token_times_s)
        assert t.token_times_s == sorted(t.token_times_s) and t.finish_s == t.token_times_s[-1]
    assert summarize(times)["num_requests"] == 30
    sim.add_request("x", [40] * 10, 5)
    with pytest.raises(ValueError, match="busy"):
        sim.advance_to(sim.clock + 10)


# ---------------------------------------------------------------------- traces
def test_trace_round_trip_and_errors(tmp_path):
    requests = traces.poisson_trace(5, 2.0, seed=1) + [
        traces.TraceRequest("5", 9.0, 3, 4, [5, 6, 7], "c1"),
        traces.TraceRequest("custom", 9.5, 2, 1, None, "7")]
    path = traces.write_trace(str(tmp_path / "t.jsonl"), requests)
    assert traces.read_trace(path) == requests
    assert json.loads(open(path).read().splitlines()[5]) == {
        "arrival_s": 9.0, "prompt_token_ids": [5, 6, 7], "output_tokens": 4, "conversation": "c1"}
    bad = tmp_path / "bad.jsonl"
    for line, message in [('{"arrival_s": 0, "output_tokens": 3}', "prompt_tokens"),
                          ('{"arrival_s": -1, "prompt_tokens": 3, "output_tokens": 3}',
                           "arrival_s"),
                          ('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 0}',
                           "output_tokens"),
                          ('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 3, "x": 1}',
                           "unknown key"),
                          ('{"arrival_s": 0, "prompt_tokens": 2, "prompt_token_ids": [1], '
                           '"output_tokens": 3}', "differs"),
                          ("not json", "not JSON")]:
        bad.write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 3}\n' + line + "\n")
        with pytest.raises(ValueError, match=message) as e:
            traces.read_trace(str(bad))
        assert f"{bad}:2:" in str(e.value)


def test_poisson_trace_is_seeded_and_bounded():
    a = traces.poisson_trace(20000, 50.0, (64, 1024), (32, 256), seed=7)
    assert a == traces.poisson_trace(20000, 50.0, (64, 1024), (32, 256), seed=7)
    assert a != traces.poisson_trace(20000, 50.0, (64, 1024), (32, 256), seed=8)
    arrivals = np.array([r.arrival_s for r in a])
    gaps = np.diff(np.concatenate([[0.0], arrivals]))
    assert (gaps > 0).all() and np.mean(gaps) == pytest.approx(1 / 50.0, rel=0.03)
    assert np.std(gaps) == pytest.approx(1 / 50.0, rel=0.05)          # exponential: std = mean
    prompts = np.array([r.prompt_tokens for r in a])
    outputs = np.array([r.output_tokens for r in a])
    assert prompts.min() == 64 and prompts.max() == 1024 and outputs.min() == 32
    assert outputs.max() == 256 and prompts.mean() == pytest.approx(544, rel=0.02)
    assert outputs.mean() == pytest.approx(144, rel=0.02)
    r = a[0]
    assert r.prompt_ids(49152, seed=0) == r.prompt_ids(49152, seed=0) != r.prompt_ids(49152, 1)
    assert len(r.prompt_ids(49152)) == r.prompt_tokens
    assert min(r.prompt_ids(49152)) >= 49152 // 8
    with pytest.raises(ValueError, match="prompt_tokens"):
        traces.poisson_trace(3, 1.0, prompt_tokens=(10, 5))


def test_multiturn_turns_share_their_prefix_and_hit_the_cache(tiny_llama_dir):
    """``bench fleet``'s chats: each turn's prompt is the previous turn's prompt, its reply (what
    the simulated worker answers) and the next message; run through one simulated engine, every
    later turn finds the earlier turn's full blocks in the prefix cache."""
    reqs = traces.multiturn_trace(conversations=3, turns=3, output_tokens=(4, 12),
                                  vocab_size=256, seed=2)
    assert len(reqs) == 9 and [r.conversation for r in reqs[:3]] == ["0", "1", "2"]
    by_conv = {c: [r for r in reqs if r.conversation == c] for c in "012"}
    for turns in by_conv.values():
        for prev, nxt in zip(turns, turns[1:]):
            reply = traces.reply_token_ids(prev.prompt_token_ids, prev.output_tokens, 256)
            assert nxt.prompt_token_ids[:prev.prompt_tokens + prev.output_tokens] == \
                prev.prompt_token_ids + reply
    sim = SimEngine.from_engine_args(tiny_llama_dir, COST, block_size=4)
    times = sim.run_trace(reqs)
    expected = sum((p.prompt_tokens + p.output_tokens - 1) // 4 * 4
                   for turns in by_conv.values() for p in turns[:-1])
    assert sim.scheduler.kv_cache_manager.prefix_cache_stats.hits >= expected
    for turns in by_conv.values():   # closed loop: a turn is sent once the previous one finished
        for prev, nxt in zip(turns, turns[1:]):
            assert times[int(nxt.request_id)].arrival_s == times[int(prev.request_id)].finish_s


def test_multiturn_first_turn_is_the_benchmarks_prompt(smollm2_dir):
    from minivllm.bench.fleet_multiturn import _messages
    from minivllm.model_executor.model_loader import load_tokenizer
    tok = load_tokenizer(smollm2_dir)
    reqs = traces.multiturn_trace(2, 2, 16, vocab_size=tok.vocab_size, tokenizer=tok)
    text = tok.apply_chat_template(_messages(1, []), add_generation_prompt=True, tokenize=False)
    assert reqs[1].prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert reqs[3].prompt_token_ids[:reqs[1].prompt_tokens] == reqs[1].prompt_token_ids


def test_kv_events_feed_a_fleet_index(tiny_llama_dir):
    """With ``kv_events=True`` each step carries the engine's own ``BlockStored`` events: a fleet's
    ``KVIndex`` fed with them finds each prompt's full blocks (kv_index's own hashing)."""
    from minivllm.disagg.fleet.kv_index import KVIndex, prompt_block_hashes
    sim = SimEngine.from_engine_args(tiny_llama_dir, COST, block_size=4, kv_events=True)
    index = KVIndex()
    prompts = {"a": list(range(40, 70)), "b": list(range(40, 60)) + [99] * 9}
    for rid, prompt in prompts.items():
        sim.add_request(rid, prompt, 3)
    while sim.has_requests():
        result = sim.step()
        index.apply("replica-0", result.kv_events)
    for prompt in prompts.values():
        hashes = prompt_block_hashes(prompt, 4)
        assert index.prefix_blocks("replica-0", hashes) == len(prompt) // 4
