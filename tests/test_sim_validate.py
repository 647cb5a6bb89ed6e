"""The simulator against real runs (minivllm/sim/validate.py): one engine's check end to end on a
tiny model (the real engine in wall-clock time, the simulated one on the same token ids), the
stored checks' schema and summaries, the figure drawn from stored JSON, a real run's replies
replayed by the simulated worker, and ``sim validate``'s command line. No Ray here: the fleet's
checks run only from the command (their stored files are checked)."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest

from minivllm.sim import validate as V
from minivllm.sim.cost_model import CostModel
from minivllm.sim.engine import SimEngine
from minivllm.sim.trace import TraceRequest, prompt_key

pytestmark = pytest.mark.usefixtures("one_thread")

COST = CostModel(step_s=2e-3, prefill_token_s=2e-5, decode_token_s=1e-4)
ENGINE = dict(block_size=4, max_model_len=256)
SMALL = dict(rate=40.0, prompt_tokens=(8, 60), output_tokens=(4, 10))


class WordTokenizer:
    """``bench throughput``'s text prompts as ids for a checkpoint without a tokenizer."""

    def encode(self, text):
        return [40 + sum(map(ord, w)) % 200 for w in text.split()][:50]


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir):
    from conftest import tiny_llm
    llm = tiny_llm(tiny_llama_dir, max_model_len=256)
    V._warm_up(llm, int(llm.vllm_config.hf_config.vocab_size))
    return llm


@pytest.fixture(scope="module")
def staggered(tiny_llama_dir, tiny_engine):
    return V.validate_engine("staggered", tiny_llama_dir, COST, num_requests=4, llm=tiny_engine,
                             staggered=SMALL, **ENGINE)


def test_one_engine_end_to_end_on_a_tiny_model(tiny_llama_dir, tiny_engine, staggered, tmp_path):
    """A 4-request staggered trace: each request measured on the real engine (added once the wall
    clock reached its arrival, every token it asked for), and simulated on the same ids; the
    summary holds both sides and their relative errors; the stored file reads back the same."""
    v = staggered
    trace = V.engine_trace("staggered", None, 256, 4, 0, **SMALL)
    assert [t.request_id for t in v.measured] == [r.request_id for r in trace]
    for m, s, r in zip(v.measured, v.simulated, trace):
        assert m.output_tokens == s.output_tokens == r.output_tokens
        assert m.prompt_tokens == s.prompt_tokens == r.prompt_tokens
        assert m.arrival_s == s.arrival_s == r.arrival_s
        for t in (m, s):
            assert 0 < t.ttft_s <= t.e2e_s and t.itl_s > 0
            assert t.e2e_s == pytest.approx(t.ttft_s + t.itl_s * (t.output_tokens - 1))
    # The simulated side is SimEngine's on the same trace and engine arguments (no wall clock).
    again = V.simulate_engine(tiny_llama_dir, COST, trace, seed=0, **ENGINE)
    assert again == v.simulated
    summary = v.summary()
    assert {"measured", "simulated", "error"} <= set(summary)
    assert set(v.variants) <= {V.RUN_CONTENTION}
    for key in V.SUMMARY_KEYS:
        m, s = summary["measured"][key], summary["simulated"][key]
        assert summary["error"][key] == pytest.approx((s - m) / m)
    assert summary["measured"]["makespan_s"] >= trace[-1].arrival_s - trace[0].arrival_s
    assert v.meta["engine_args"] == ENGINE and len(v.meta["trace"]) == 4
    assert "prompt_token_ids" not in v.meta["trace"][0]       # lengths only
    loaded = V.Validation.load(v.save(str(tmp_path)))
    assert loaded.measured == v.measured and loaded.simulated == v.simulated
    assert loaded.summary() == json.loads(json.dumps(summary))
    # bench throughput's batch workload, capped: every request at 0, the bench's lengths.
    batch = V.validate_engine("batch32", tiny_llama_dir, COST, num_requests=3, llm=tiny_engine,
                              tokenizer=WordTokenizer(), **ENGINE)
    from minivllm.bench.throughput import make_workload
    assert [t.output_tokens for t in batch.measured] == [n for _, n in make_workload(32)[:3]]
    assert all(t.arrival_s == 0 for t in batch.measured)
    assert "| engine_batch32 | 3 |" in V.table([batch])


def test_a_request_waits_for_its_arrival(tiny_llama_dir, tiny_engine):
    """measure_engine adds a request only once the wall clock reaches its arrival, and times its
    TTFT from there: the engine idles before a late arrival."""
    import time
    ids = list(range(40, 60))
    trace = [TraceRequest("a", 0.0, len(ids), 3, ids),
             TraceRequest("b", 0.3, len(ids), 3, [i + 1 for i in ids])]
    t0 = time.perf_counter()
    a, b = V.measure_engine(tiny_engine, trace)
    assert time.perf_counter() - t0 >= 0.3
    assert b.arrival_s == 0.3 and 0 < b.ttft_s < 0.3      # from its arrival, not from the start
    assert a.e2e_s < 0.3 and V.summarize_timings([a, b])["makespan_s"] >= 0.3


def test_from_stamps_and_errors():
    t = V.RequestTiming.from_stamps("r", 1.0, 10, [1.5, 1.7, 1.9], num_tokens=5)
    assert (t.ttft_s, t.e2e_s, t.output_tokens) == (0.5, pytest.approx(0.9), 5)
    assert t.itl_s == pytest.approx(0.4 / 4)           # the span over the tokens less one
    assert V.RequestTiming.from_stamps("r", 0.0, 10, []).e2e_s is None
    err = V.relative_errors({"ttft_p50_s": 1.1, "itl_p50_s": None}, {"ttft_p50_s": 1.0,
                                                                     "itl_p50_s": 0.1})
    assert err["ttft_p50_s"] == pytest.approx(0.1) and err["itl_p50_s"] is None
    s = V.summarize_timings([t, V.RequestTiming.from_stamps("x", 0.0, 3, [])])
    assert s["failed"] == 1 and s["num_requests"] == 2


def test_the_simulated_worker_answers_with_a_real_runs_replies(tiny_llama_dir):
    """answer_with: a prompt's reply is the given tokens (others keep reply_token), so a chat's
    next turn, built from the real reply, finds it in the simulated prefix cache."""
    prompt = list(range(40, 72))                    # 8 blocks of 4
    reply = [7, 8, 9, 10, 11, 12, 13, 14]
    sim = SimEngine.from_engine_args(tiny_llama_dir, COST, **ENGINE)
    sim.worker.answer_with({prompt_key(prompt): reply})
    r1 = sim.add_request("t0", prompt, len(reply))
    other = sim.add_request("x", list(range(100, 120)), 4)
    while sim.has_unfinished_requests():
        sim.step()
    assert r1.output_token_ids == reply and other.output_token_ids != reply[:4]
    nxt = sim.add_request("t1", prompt + reply + [99, 98, 97], 2)
    sim.step()
    assert nxt.num_cached_tokens == (len(prompt) + len(reply) - 1) // 4 * 4


def _stored() -> list[V.Validation]:
    return V.load_validations()


def test_stored_checks_have_the_schema_and_their_summaries_hold():
    """Every stored check: its format, the measured and simulated side per request, the machine,
    date, command, load average and cost model; its summary and errors as recomputed from its
    requests. One file per workload, and the figure drawn from them."""
    found = {v.name: v for v in _stored()}
    assert set(found) == {f"engine_{w}" for w in V.ENGINE_WORKLOADS} | {
        f"fleet_{w}" for w in V.FLEET_WORKLOADS}
    for name in found:
        with open(os.path.join(V.VALIDATION_DIR, f"{name}.json")) as fh:
            data = json.load(fh)
        assert data["format"] == V.FORMAT and data["name"] == name
        meta = data["meta"]
        for key in ("machine", "cpu", "cpu_count", "torch", "date", "command", "load_average",
                    "cost_model", "trace"):
            assert meta.get(key) is not None, (name, key)
        assert meta["command"].startswith("python -m minivllm.sim validate")
        assert len(meta["load_average"]) == 2
        assert set(meta["cost_model"]["coefficients"]) >= {"step_s", "decode_token_s"}
        assert len(data["requests"]) == len(meta["trace"]) >= 1
        for row in data["requests"]:
            for side in ("measured", "simulated"):
                assert set(row[side]) == {"ttft_s", "itl_s", "e2e_s"}
                assert row[side]["ttft_s"] > 0 and row[side]["e2e_s"] >= row[side]["ttft_s"]
        assert data["summary"] == json.loads(json.dumps(V.Validation.from_json(data).summary()))
        assert data["what"] == name.split("_")[0]
    assert found["fleet_2p2d_poisson"].variants, "2P2D: the shared-cores simulation"
    assert os.path.exists(V.FIGURE)


def test_the_shipped_profile_is_the_one_validated():
    """The notebook's cost model (minivllm/sim/profiles/smollm2_cpu.json) is the one the stored
    checks simulated with, and says where and when it was fitted."""
    shipped = CostModel.load(os.path.join(V.PROFILE_DIR, "smollm2_cpu.json"))
    assert shipped.meta["machine"] and shipped.meta["date"] and shipped.acceptance is not None
    for v in _stored():
        used = v.meta["cost_model"]
        assert used["coefficients"] == pytest.approx(shipped.coefficients), v.name
        assert used["contention"] == pytest.approx(shipped.contention)
        assert used["date"] == shipped.meta["date"]


def test_the_figure_is_drawn_from_stored_json(staggered, tmp_path):
    """plot_validation on a folder of stored checks: one panel per metric, a point per request
    with both sides, the y = x line and the +-15% band, log axes."""
    import matplotlib
    matplotlib.use("Agg")
    folder = tmp_path / "checks"
    staggered.save(str(folder))
    other = dataclasses.replace(staggered, name="engine_other", what="engine")
    other.save(str(folder))
    fig = V.plot_validation(str(folder))
    axes = fig.axes
    assert len(axes) == 2
    for ax in axes:
        assert ax.get_xscale() == ax.get_yscale() == "log"
        points = [c for c in ax.collections if c.get_offsets().shape[1:] == (2,)
                  and len(c.get_offsets()) == len(staggered.measured)]
        assert len(points) == 2                       # one scatter per stored check
        (line,) = ax.get_lines()
        x, y = line.get_data()
        assert list(x) == list(y)                     # y = x
    labels = [t.get_text() for t in axes[-1].get_legend().get_texts()]
    assert "\u00b115%" in labels and "engine_staggered" in labels
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_sim_validate_command_line(tmp_path, capsys):
    """``python -m minivllm.sim validate``: registered beside run / fleet / plan; an unknown
    workload is refused naming the choices; a missing cost model says how to make one."""
    from minivllm.sim.__main__ import main
    path = tmp_path / "cost.json"
    COST.save(str(path))
    assert main(["validate", "--workloads", "bogus", "--cost-model", str(path)]) == 2
    assert "unknown workloads ['bogus']" in capsys.readouterr().err
    assert main(["validate", "--cost-model", str(tmp_path / "none.json")]) == 2
    assert "python -m minivllm.sim profile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    assert "--what" in capsys.readouterr().out
