"""N-gram proposer: vLLM's longest-then-earliest rule, the recency-biased variant, caps and edge cases."""
import random

import numpy as np
import pytest

from minivllm.spec_decode.ngram_proposer import NgramProposer


def _brute_force(tokens, min_n, max_n, k, max_model_len, match):
    """The rule spelled out: try n from longest to shortest; earliest (or latest) earlier occurrence."""
    total = len(tokens)
    if total < min_n:
        return []
    if max_model_len is not None:
        k = min(k, max_model_len - total)
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[total - n:]
        # Occurrences that end before the last token (they may overlap the suffix).
        starts = [s for s in range(0, total - n) if tokens[s:s + n] == suffix]
        if starts:
            start = (starts[0] if match == "first" else starts[-1]) + n
            return tokens[start:start + k]
    return []


def test_overlapping_match():
    assert NgramProposer(3, 3, 5).propose([1, 2, 1, 2, 1]) == [2, 1]


def test_first_versus_last_occurrence():
    context = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    assert NgramProposer(3, 3, 2).propose(context) == [9, 1]
    assert NgramProposer(3, 3, 2, match="last").propose(context) == [8, 5]
    assert NgramProposer(2, 3, 3, match="first").propose(np.array(context)) == [9, 1, 2]


def test_longest_n_wins_over_earlier_shorter_match():
    # [2, 3] first occurs at index 1 (followed by 4); [1, 2, 3] only at index 5 (followed by 5, 6).
    context = [7, 2, 3, 4, 0, 1, 2, 3, 5, 6, 1, 2, 3]
    assert NgramProposer(2, 3, 2).propose(context) == [5, 6]
    assert NgramProposer(2, 2, 2).propose(context) == [4, 0]


def test_caps_and_empty_cases():
    context = [1, 2, 3, 4, 5, 1, 2, 3, 4, 1, 2]
    assert NgramProposer(2, 2, 5).propose(context) == [3, 4, 5, 1, 2]
    assert NgramProposer(2, 2, 5, max_model_len=len(context) + 2).propose(context) == [3, 4]
    assert NgramProposer(2, 2, 5, max_model_len=len(context)).propose(context) == []
    assert NgramProposer(2, 2, 5).propose([1, 2, 1, 2]) == [1, 2]  # only as many as follow the match
    assert NgramProposer(4, 5, 3).propose([1, 2, 1]) == []  # min_n longer than the context
    assert NgramProposer(2, 3, 3).propose([1, 2, 3, 4, 5]) == []  # no repeat
    assert NgramProposer(1, 1, 3).propose([]) == []
    assert NgramProposer(1, 1, 3).propose([5]) == []


def test_batch_and_load_model():
    p = NgramProposer(1, 2, 2)
    p.load_model(object())
    assert p.propose_batch([[1, 2, 1], [3], [4, 5, 6, 4]]) == [[2, 1], [], [5, 6]]


def test_bad_arguments():
    for args, kw in (((0, 2, 3), {}), ((3, 2, 3), {}), ((1, 2, 0), {}), ((1, 2, 3), {"match": "middle"})):
        with pytest.raises(ValueError):
            NgramProposer(*args, **kw)


@pytest.mark.parametrize("match", ["first", "last"])
def test_matches_brute_force_on_random_sequences(match):
    rng = random.Random(0)
    for _ in range(1500):
        tokens = [rng.randint(0, rng.randint(1, 4)) for _ in range(rng.randint(0, 30))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 5)
        max_model_len = rng.choice([None, len(tokens) + rng.randint(-1, 4)])
        got = NgramProposer(min_n, max_n, k, max_model_len, match).propose(tokens)
        assert got == _brute_force(tokens, min_n, max_n, k, max_model_len, match), (tokens, min_n, max_n)


def test_long_context_is_fast():
    import time
    rng = np.random.default_rng(0)
    context = rng.integers(0, 500, 4000).tolist() + [1, 2, 3, 4, 5]
    context[100:105] = [1, 2, 3, 4, 5]
    p = NgramProposer(3, 5, 4)
    start = time.perf_counter()
    for _ in range(100):
        out = p.propose(context)
    assert out == context[105:109]
    assert (time.perf_counter() - start) / 100 < 0.01  # well under 10 ms per call
