"""learn/viz/residual.py: the rejected position, its residual and the race, read from step records; and
VerifyProbe on a real engine (tiny model) records what the rejection sampler tested against."""
from __future__ import annotations

import torch

from minivllm.learn.viz.residual import (VerifyProbe, race_counts, rejection_of,
                                         render_logits_rows_text, render_rejection_text)
from minivllm.trace import StepRecord


def _step(draft_probs=None) -> StepRecord:
    target = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]])
    positions = [dict(draft_token_id=1, p_target=0.6, p_draft=1.0, uniform=0.8, accepted=False,
                      kind="recovered", output_token_id=2)]
    return StepRecord(step=3, events=[
        {"kind": "schedule", "num_scheduled_tokens": {"a": 3, "b": 5},
         "scheduled_spec_decode_tokens": {"a": [1, 3]}},
        {"kind": "slot_mapping", "req_ids": ["a", "b"]},
        {"kind": "spec_verify", "req_id": "a", "positions": positions},
        {"kind": "verify_probs", "req_ids": ["a", "b"], "num_draft_tokens": [2, 0],
         "logits_indices": [0, 1, 2, 7], "target_logits_indices": [0, 1],
         "bonus_logits_indices": [2, 3], "target_probs": target, "draft_probs": draft_probs}])


def test_a_one_hot_rejection_removes_the_draft_token_and_renormalises():
    r = rejection_of(_step(), "a")
    assert r["position"] == 0 and r["one_hot"]
    assert torch.allclose(r["residual"], torch.tensor([0.25, 0.0, 0.75, 0.0]))
    text = render_rejection_text(r)
    assert "p_target/p_draft = 0.600/1.000 = 0.600 < u = 0.800" in text
    assert "<- recovered" in text and "recovered token: 2" in text and "0.7500" in text
    assert rejection_of(_step(), "b") is None


def test_a_probabilistic_draft_takes_mass_from_every_token_it_over_proposed():
    draft = torch.tensor([[0.0, 0.8, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
    r = rejection_of(_step(draft), "a")
    assert torch.allclose(r["residual"], torch.tensor([0.1, 0.0, 0.2, 0.0]) / 0.3)


def test_the_exponential_race_wins_in_proportion_to_the_unnormalised_residual():
    residual = torch.tensor([0.0, 3.0, 1.0, 0.0])       # normalised: 0.75, 0.25
    wins = race_counts(residual, draws=4000, seed=0)
    assert wins[0] == 0 and wins[3] == 0 and wins.sum() == 4000
    assert abs(wins[1].item() / 4000 - 0.75) < 0.03


def test_the_rows_text_says_which_rows_get_logits_and_why():
    text = render_logits_rows_text(_step())
    assert "req a: rows 0..2 (3 tokens) -> logits rows [0, 1, 2]: verify: 1 sampled token + 2 drafts" in text
    assert "req b: rows 3..7 (5 tokens) -> logits rows [7]: no drafts" in text


def test_the_probe_records_the_sampler_tensors_and_goes_away(tiny_llama_dir):
    from minivllm import LLM, SamplingParams
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True,
              speculative_config={"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 2,
                                  "num_speculative_tokens": 2})
    engine = llm.llm_engine
    engine.tracer.enabled = True
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 8, 9] * 3},
                       SamplingParams(temperature=0, max_tokens=12))   # greedy: the tiny model repeats itself
    with VerifyProbe(engine) as probe:
        while engine.has_unfinished_requests():
            engine.step()
    assert "forward" not in vars(probe.sampler)             # the class's forward again
    events = [e for s in engine.tracer.steps for e in s.of("verify_probs")]
    assert events, "no verify happened"
    for s in engine.tracer.steps:
        for ev in s.of("verify_probs"):
            positions = [p for p in s.first("spec_verify")["positions"] if p["draft_token_id"] is not None]
            probs = ev["target_probs"]
            assert probs.shape[0] == sum(ev["num_draft_tokens"])
            for t, p in enumerate(positions):          # the record's p_target is the same tensor's
                assert abs(probs[t, p["draft_token_id"]].item() - p["p_target"]) < 1e-6


def test_slot_rows_counts_what_was_computed_before_the_step_and_the_lookahead_block(tiny_llama_dir):
    """A draft model's first verify, 10 prompt tokens in: ``computed`` is the KV written before the
    step (the first position the step feeds), and the k lookahead slots take the request past
    its first 16-token block: 10 + 4 fits in one, 10 + 4 + 3 needs a second."""
    from minivllm import LLM, SamplingParams
    from minivllm.learn.viz.residual import slot_rows
    llm = LLM(model=tiny_llama_dir, skip_tokenizer_init=True,
              speculative_config={"method": "draft_model", "draft_num_layers": 1,
                                  "num_speculative_tokens": 3})
    engine = llm.llm_engine
    engine.tracer.enabled = True
    engine.add_request("r", {"prompt_token_ids": list(range(5, 15))},
                       SamplingParams(temperature=0, max_tokens=8))
    while engine.has_unfinished_requests():
        engine.step()
    step = next(s for s in engine.tracer.steps
                if s.first("schedule")["scheduled_spec_decode_tokens"].get("r"))
    scheduler = engine.engine_core.scheduler
    rows = slot_rows(step, "r", scheduler.block_size, scheduler.num_lookahead_tokens)
    assert rows["computed"] == step.first("slot_mapping")["positions"][0] == 10
    assert (rows["scheduled"], rows["drafts"], rows["lookahead"]) == (4, 3, 3)
    assert (rows["block_size"], rows["blocks"], rows["reserved"]) == (16, 2, 32)
