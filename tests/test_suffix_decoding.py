"""Suffix decoding (``method="suffix"``): the readable tree (spec_decode/suffix_tree.py), the
request lifecycle of ``SuffixDecodingCache`` and the proposer, the options' ranges, and greedy
output identical with and without it. Equality with arctic-inference's tree, and with vLLM 0.32's engine,
is conformance case j (tests/conformance/test_j_suffix.py)."""
from __future__ import annotations

import random

import pytest

from conftest import generate_tokens, plain_greedy_tokens, runner_of, tiny_llm
from minivllm import LLM, SamplingParams
from minivllm.config import SpeculativeConfig
from minivllm.spec_decode.suffix_decoding import SuffixDecodingCache
from minivllm.spec_decode.suffix_tree import SuffixTree

pytestmark = pytest.mark.usefixtures("one_thread")

A, B, C = 1, 2, 3


def counts(node) -> dict:
    return {child.token: (child.count, counts(child)) for child in node.ranked}


def test_the_docstrings_tree():
    tree = SuffixTree(max_depth=3)
    tree.extend(0, [A, B, A, C])
    assert tree.root.count == 4
    assert counts(tree.root) == {A: (2, {B: (1, {A: (1, {})}), C: (1, {})}),
                                 B: (1, {A: (1, {C: (1, {})})}), C: (1, {})}
    assert tree.draw(decode="_abc".__getitem__).splitlines()[:4] == [
        "root (4)", "|-- a (2)", "|   |-- b (1)", "|   |   `-- a (1)"]
    # Context "... a": a (2) has children b (1) and c (1); the tie goes to b, which came first.
    draft = tree.speculate([C, A], max_spec_tokens=4, max_spec_factor=4.0, min_token_prob=0.1)
    assert (draft.token_ids, draft.probs, draft.match_len) == ([B, A], [0.5, 0.5], 1)
    assert draft.counts == [(1, 2), (1, 1)]


def test_min_token_prob_and_the_length_caps():
    tree = SuffixTree(max_depth=8)
    tree.extend(0, [A, B, C, A, B, A, B, C])
    # After "a b": c twice, a once -> c at 2/3, then a at 2/3 * 1/2 = 1/3.
    walk = tree.speculate([C, A, B], max_spec_tokens=8, max_spec_factor=8.0, min_token_prob=0.0)
    assert walk.token_ids[:2] == [C, A] and walk.probs[:2] == pytest.approx([2 / 3, 1 / 3])
    assert tree.speculate([C, A, B], 8, 8.0, min_token_prob=0.5).token_ids == [C]
    assert len(tree.speculate([C, A, B], 1, 8.0, 0.0).token_ids) == 1          # max_spec_tokens
    assert len(tree.speculate([C, A, B], 8, 0.5, 0.0).token_ids) == 1          # 0.5 * 2 tokens
    assert tree.speculate([C, A, B], 8, 0.0, 0.0).token_ids == []
    assert tree.speculate([7, 7], 8, 8.0, 0.0).token_ids == []                 # no match


def test_children_stay_ranked_and_remove_undoes_extend():
    rng = random.Random(0)
    for depth in (1, 3, 24):
        tree = SuffixTree(depth)
        alone = SuffixTree(depth)
        keep = [rng.randrange(4) for _ in range(60)]
        tree.extend(0, [rng.randrange(4) for _ in range(50)])
        tree.extend(1, keep)
        alone.extend(1, keep)
        stack = [tree.root]
        while stack:
            node = stack.pop()
            assert [c.count for c in node.ranked] == sorted((c.count for c in node.ranked),
                                                            reverse=True)
            assert sorted(node.children) == sorted(c.token for c in node.ranked)
            stack.extend(node.ranked)
        tree.remove(0)
        assert tree.root.count == alone.root.count == 60

        def as_sets(node):
            return {c.token: (c.count, as_sets(c)) for c in node.ranked}
        assert as_sets(tree.root) == as_sets(alone.root)


def test_cache_lifecycle_global_tree_and_fifo_eviction():
    cache = SuffixDecodingCache(max_tree_depth=8, max_cached_requests=2)
    cache.start_request("r0", [9, 9])
    cache.add_active_response("r0", [A, B, C, A, B, C])
    cache.stop_request("r0")
    assert list(cache.active_requests) == [] and list(cache.cached_requests) == ["r0"]
    # A new request with an unrelated prompt drafts r0's output from the global tree.
    cache.start_request("r1", [7])
    cache.add_active_response("r1", [A, B])
    draft, tree = cache.speculate("r1", [7, A, B], max_spec_tokens=4, max_spec_factor=2.0)
    assert tree == "global" and draft.token_ids == [C, A, B, C]
    cache.start_request("r2", [7])                     # over the limit of 2: the oldest goes
    assert list(cache.cached_requests) == ["r1", "r2"] and cache.global_tree.root.count == 2
    cache.start_request("r3", [7])
    assert list(cache.cached_requests) == ["r2", "r3"] and cache.global_tree.root.count == 0
    with pytest.raises(ValueError, match="already active"):
        cache.start_request("r1", [1])
    off = SuffixDecodingCache(max_tree_depth=8, max_cached_requests=0)   # no global tree
    off.start_request("x", [1])
    off.add_active_response("x", [A, B, A])
    assert list(off.cached_requests) == [] and off.global_tree.root.count == 0


@pytest.mark.parametrize("field,value,allowed", [
    ("suffix_decoding_max_tree_depth", 0, "an integer >= 1"),
    ("suffix_decoding_max_cached_requests", -1, "an integer >= 0"),
    ("suffix_decoding_max_spec_factor", -0.5, ">= 0"),
    ("suffix_decoding_min_token_prob", 1.5, r"in \[0, 1\]"),
    ("suffix_decoding_max_tree_depth", 2.5, "an integer >= 1"),
])
def test_out_of_range_options_name_the_field(tiny_llama_dir, field, value, allowed):
    with pytest.raises(ValueError, match=f"speculative_config.{field} must be {allowed}"):
        LLM(model=tiny_llama_dir, skip_tokenizer_init=True,
            speculative_config={"method": "suffix", field: value})


def test_the_server_refuses_an_out_of_range_option_at_start(tiny_llama_dir, capsys):
    """The server's speculative config is fixed at start (vLLM's ``--speculative-config``; no
    request can change it): a bad option stops ``serve`` with a usage error naming the field,
    before anything listens."""
    from minivllm.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", tiny_llama_dir, "--port", "0", "--speculative-config",
              '{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}'])
    assert e.value.code == 2
    assert "speculative_config.suffix_decoding_min_token_prob must be in [0, 1]" in \
        capsys.readouterr().err


def test_suffix_takes_no_draft_model(tiny_llama_dir):
    with pytest.raises(ValueError, match="method 'suffix' .* takes no 'model'"):
        SpeculativeConfig(method="suffix", model=tiny_llama_dir)
    from minivllm.entrypoints.openai.api_server import build_async_llm, make_arg_parser
    args = make_arg_parser().parse_args(
        ["--model", tiny_llama_dir, "--speculative-config",
         '{"method": "suffix", "suffix_decoding_min_token_prob": -1}'])
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob must be in"):
        build_async_llm(args)                          # the server refuses to start


# Repetitive and not, a prompt shorter than a block, and prompts that share a pattern.
PROMPTS = [[5, 17, 42], list(range(1, 30)), [9, 8, 7, 6] * 6, [7],
           [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [3, 1, 4], [3, 1, 4, 1, 5, 9]]
VARIANTS = {"default": {}, "preemption": dict(num_gpu_blocks_override=22),
            "chunked_prefill": dict(max_num_batched_tokens=7, max_num_seqs=3),
            "async_scheduling": dict(async_scheduling=True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_suffix_equals_plain(tiny_gqa_dir, variant, k):
    kw = VARIANTS[variant]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm = tiny_llm(tiny_gqa_dir, spec=dict(method="suffix", num_speculative_tokens=k), **kw)
    assert generate_tokens(llm, PROMPTS, params) == plain_greedy_tokens(tiny_gqa_dir, PROMPTS, 32,
                                                                        **kw)
    m = {x.name: getattr(x, "values", getattr(x, "value", None)) for x in llm.get_metrics()}
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0
    assert len(m["vllm:spec_decode_num_accepted_tokens_per_pos"]) == k


def test_a_second_request_reuses_the_first_ones_output(tiny_gqa_dir):
    """The same prompt twice, one after the other: the second request drafts the first one's
    output from the global tree, so it needs fewer verify steps."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = tiny_llm(tiny_gqa_dir, spec=dict(method="suffix", num_speculative_tokens=8))
    prompt = [[11, 250, 3, 77]]

    def verify_steps():
        names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")
        before = {x.name: getattr(x, "value", None) or 0 for x in llm.get_metrics()}
        out = generate_tokens(llm, prompt, params)
        after = {x.name: getattr(x, "value", None) or 0 for x in llm.get_metrics()}
        return (out, *(after[n] - before[n] for n in names))

    first, drafts_first, accepted_first = verify_steps()
    second, drafts_second, accepted_second = verify_steps()
    assert first == second
    assert accepted_second >= 30 > accepted_first and drafts_second <= 8
    assert len(runner_of(llm).drafter.suffix_cache.cached_requests) == 2


def test_the_last_match_is_kept_for_the_tour(tiny_gqa_dir):
    llm = tiny_llm(tiny_gqa_dir, spec=dict(method="suffix", num_speculative_tokens=4))
    generate_tokens(llm, [[9, 8, 7, 6] * 6], SamplingParams(temperature=0.0, max_tokens=3,
                                                             ignore_eos=True))
    (match,) = runner_of(llm).drafter.last_match.values()
    assert match.tree in ("request", "global") and match.matched_suffix
    assert len(match.path) == len(match.scores) > 0
    assert all(0 < s <= 1 for s in match.scores)
    assert all(0 < count <= parent for _, count, parent in match.path)


def test_the_spec2_stop_shows_the_suffix_match(tiny_gqa_dir):
    """The tour's spec.2 ``show`` expression, evaluated as the stop does in the runner's frame."""
    from minivllm.step_table import STEPS
    from minivllm.learn.tour import short
    show = next(s for s in STEPS if s.id == "spec.2").show
    llm = tiny_llm(tiny_gqa_dir, spec=dict(method="suffix", num_speculative_tokens=4))
    generate_tokens(llm, [[9, 8, 7, 6] * 6], SamplingParams(temperature=0.0, max_tokens=3,
                                                             ignore_eos=True))
    frame = {"self": runner_of(llm), "k": 4, "limits": {}, "drafts": {}}
    printed = short(eval(show, {}, frame)[3])
    assert "matched_suffix=[" in printed and "path=[(" in printed and "scores=[" in printed


def test_under_pd_the_decode_instance_drafts_as_a_colocated_one(tiny_gqa_dir, tmp_path):
    """P computes the prompts (and stores their KV), D loads it and decodes with suffix decoding:
    D's outputs and spec-decode counters equal a colocated run's (the trees start from the prompt
    on D, as on any instance)."""
    from minivllm.config import KVTransferConfig
    spec = dict(method="suffix", num_speculative_tokens=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def counters(llm):
        m = {x.name: getattr(x, "values", getattr(x, "value", None)) for x in llm.get_metrics()}
        return [m[n] for n in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                               "vllm:spec_decode_num_accepted_tokens_per_pos")]
    colocated = tiny_llm(tiny_gqa_dir, spec, num_gpu_blocks_override=64)
    ref = generate_tokens(colocated, PROMPTS[:3], greedy)
    kv = KVTransferConfig("SharedStorageConnector", "kv_both",
                          {"shared_storage_path": str(tmp_path)})
    generate_tokens(tiny_llm(tiny_gqa_dir, spec, kv_transfer_config=kv, num_gpu_blocks_override=64),
                    PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    d = tiny_llm(tiny_gqa_dir, spec, kv_transfer_config=kv, num_gpu_blocks_override=64)
    out = d.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref
    assert sum(o.num_cached_tokens for o in out) > 0          # D loaded P's blocks
    assert counters(d) == counters(colocated) and counters(d)[1] > 0
