"""Dynamic k (``num_speculative_tokens_per_batch_size``, vLLM 0.32's
``vllm/v1/spec_decode/dynamic/utils.py``): the validation, the dense lookup (against vLLM's own
function where the vLLM source is here), and the engine drafting this step's k."""
from __future__ import annotations

import importlib.util
import os
import random

import pytest

from conftest import runner_of, tiny_llm
from minivllm import SamplingParams
from minivllm.spec_decode.dynamic import (build_dynamic_sd_schedule_lookup,
                                          num_spec_tokens_to_schedule,
                                          validate_and_normalize_dynamic_sd_schedule)

pytestmark = pytest.mark.usefixtures("one_thread")
VLLM_UTILS = os.path.join(os.path.dirname(__file__), "..", ".venv-vllm", "lib", "python3.11",
                          "site-packages", "vllm", "v1", "spec_decode", "dynamic", "utils.py")


def test_lookup_by_hand():
    # A gap (17-31) keeps the earlier k, past the last range keeps the last k, k is clamped to 3.
    lookup = build_dynamic_sd_schedule_lookup([(32, 40, 1), (1, 16, 5)], 48, 3)
    assert lookup[1:17] == [3] * 16 and lookup[17:32] == [3] * 15
    assert lookup[32:41] == [1] * 9 and lookup[41:] == [1] * 8
    assert num_spec_tokens_to_schedule(3, lookup, 33) == 1
    assert num_spec_tokens_to_schedule(3, None, 33) == 3
    assert build_dynamic_sd_schedule_lookup([(1, 1, 2), (2, 8, 0)], 8, 4)[1:] == [2] + [0] * 7


@pytest.mark.parametrize("schedule,match", [
    ([], "non-empty"), ("1,8,3", "non-empty"), ([(1, 8)], "3-item"), ([(0, 8, 3)], "positive"),
    ([(1, 8, 3), (8, 9, 1)], "overlap"), ([(5, 2, 1)], "start must be <= end"),
    ([(1, 2, -1)], ">= 0"), ([(2, 8, 3)], "start at 1")])
def test_validation(schedule, match):
    with pytest.raises(ValueError, match=match):
        validate_and_normalize_dynamic_sd_schedule(schedule)
    from minivllm.config import SpeculativeConfig
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
        SpeculativeConfig(num_speculative_tokens_per_batch_size=schedule)


@pytest.mark.skipif(not os.path.exists(VLLM_UTILS), reason="vLLM 0.32's source is not here")
def test_lookup_equals_vllm_on_random_schedules():
    spec = importlib.util.spec_from_file_location("vllm_dynamic_utils", VLLM_UTILS)
    vllm_utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_utils)   # plain Python, no vLLM import behind it
    rng = random.Random(0)
    for _ in range(500):
        schedule, nxt = [], 1
        for i in range(rng.randint(1, 4)):
            start = 1 if i == 0 else nxt + rng.randint(0, 5)
            end = start + rng.randint(0, 8)
            schedule.append([start, end, rng.randint(0, 6)])
            nxt = end + 1
        rng.shuffle(schedule)
        max_bs, k = rng.randint(1, 40), rng.randint(1, 5)
        assert build_dynamic_sd_schedule_lookup(schedule, max_bs, k) == \
            vllm_utils.build_dynamic_sd_schedule_lookup(schedule, max_bs, k)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_drafts_this_steps_k(tiny_llama_dir, async_scheduling):
    """k = 3 at batch 1, 0 from batch 2: one request drafts, four do not; greedy output is the
    plain output either way."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "prompt_lookup_max": 3, "num_speculative_tokens_per_batch_size": [(1, 1, 3), (2, 64, 0)]}
    prompt = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = tiny_llm(tiny_llama_dir).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    want = list(plain[0].outputs[0].token_ids)
    for n, drafts in ((1, True), (4, False)):
        llm = tiny_llm(tiny_llama_dir, spec, async_scheduling=async_scheduling)
        proposed = []
        propose = runner_of(llm).propose_draft_token_ids
        runner_of(llm).propose_draft_token_ids = lambda *a: (
            d := propose(*a), proposed.append(d))[0]
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
        assert all(list(o.outputs[0].token_ids) == want for o in outs)
        m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
        assert (m["vllm:spec_decode_num_draft_tokens"] > 0) == drafts, m
