"""n > 1 (vLLM's ParentRequest): n CompletionOutputs under the parent's id, child i seeded with
seed + i (so it equals a single request with that seed), the prompt's blocks shared through the
prefix cache, greedy n > 1 refused as vLLM does, and an abort by the parent's id."""
import pytest

from conftest import tiny_llm
from minivllm import SamplingParams

PROMPT = list(range(10, 30))     # 20 tokens: 4 full blocks of 4 can be shared


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return tiny_llm(tiny_llama_dir)


def _hits(llm):
    return {m.name: m for m in llm.get_metrics()}["vllm:prefix_cache_hits"].value


def test_n_outputs_each_a_seeded_child(llm):
    before = _hits(llm)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, logprobs=1)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and len(c.logprobs) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    # The two children after the first found the prompt's full blocks in the prefix cache.
    assert _hits(llm) - before >= 2 * 16
    for i, c in enumerate(out.outputs):
        single = llm.generate([{"prompt_token_ids": PROMPT}],
                              SamplingParams(temperature=1.0, seed=5 + i, max_tokens=6),
                              use_tqdm=False)[0]
        assert single.outputs[0].token_ids == c.token_ids


def test_greedy_n_is_refused_and_abort_by_parent_id(llm):
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        SamplingParams(n=2, temperature=0.0)
    engine = llm.llm_engine
    engine.add_request("p", {"prompt_token_ids": PROMPT}, SamplingParams(n=2, max_tokens=50))
    engine.step()
    engine.abort_request(["p"])
    assert not engine.has_unfinished_requests()
