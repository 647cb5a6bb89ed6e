"""bench profile: its timers account for a step's time by category, exclusively, and cost nothing
once removed; the weight-streaming floor's inputs are sane."""
import torch
from conftest import generate_tokens, runner_of, tiny_llm

from minivllm import SamplingParams
from minivllm.bench import profile

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9, 10]]


def test_nested_timers_are_exclusive():
    t = profile.StepTimers()
    inner = t.wrap(lambda: sum(range(20000)), "projections")
    outer = t.wrap(lambda: [inner() for _ in range(3)], "step")
    outer()
    assert t.inclusive["step"] >= t.total["projections"] > 0
    assert abs(t.total["step"] + t.total["projections"] - t.inclusive["step"]) < 1e-6


def test_breakdown_of_a_spec_decode_run(tiny_llama_dir):
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    llm = tiny_llm(tiny_llama_dir, spec, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = generate_tokens(llm, PROMPTS, params)
    timers = profile.StepTimers()
    profile.install(llm, timers)
    assert generate_tokens(llm, PROMPTS, params) == want   # timing changes nothing
    for cat in ("projections", "LM head", "attention", "norm and rotary", "sampling or rejection",
                "drafter", "scheduler", "input preparation", "model other"):
        assert timers.total[cat] > 0, cat
    assert sum(v for k, v in timers.total.items()) <= timers.inclusive["step"] * 1.0001 + 1e-6
    model = runner_of(llm).model
    nbytes = profile.weight_bytes_per_token(model)
    every = sum(p.numel() * 4 for p in model.parameters())
    assert 0 < nbytes <= every
    assert profile.copy_bandwidth(8 << 20, rounds=2) > 1e8   # > 0.1 GB/s on any machine


def test_suffix_tree_work_is_timed_apart_inside_the_drafter(tiny_llama_dir):
    """--method suffix: the proposer's calls into its trees get the "suffix tree" row, taken out
    of the drafter's (which is otherwise opaque)."""
    llm = tiny_llm(tiny_llama_dir, dict(method="suffix", num_speculative_tokens=3), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = generate_tokens(llm, PROMPTS, params)
    timers = profile.StepTimers()
    profile.install(llm, timers)
    assert generate_tokens(llm, PROMPTS, params) == want
    assert timers.total["suffix tree"] > 0 and timers.total["drafter"] > 0
    assert timers.inclusive["drafter"] >= timers.total["drafter"] + timers.total["suffix tree"] - 1e-6
    assert profile.METHODS["suffix"]["method"] == "suffix"


def test_gc_pauses_count_the_collector_and_its_full_collections():
    import gc
    pauses = profile.GcPauses()
    gc.callbacks.append(pauses)
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        gc.callbacks.remove(pauses)
    assert pauses.full == 1 and pauses.seconds > 0
