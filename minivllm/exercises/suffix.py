"""Notebook 04, exercise 5: walk a suffix tree greedily by frequency (suffix decoding's draft,
spec_decode/suffix_tree.py ``SuffixTree.walk``; vLLM 0.32's ``method="suffix"``).

A node is ``{"count": int, "children": [(token, node), ...]}``, children highest count first (ties
already in the order the tree keeps). From the matched node, take the first child, multiply the
running probability by ``count(child) / count(node)``, stop when it falls below
``min_token_prob``, else draft the child's token and go on; at most ``max_tokens`` tokens.
"""
from __future__ import annotations

import random
from typing import Any, Callable

from minivllm.exercises.spec import _call, _fail, _fmt, _passed
from minivllm.spec_decode.suffix_tree import SuffixTree


def tree_as_dict(node: Any) -> dict:
    """A ``suffix_tree.Node`` as the exercise's nested dicts."""
    return {"count": node.count, "children": [(c.token, tree_as_dict(c)) for c in node.ranked]}


def reference_walk_suffix_tree(node: dict, max_tokens: int,
                               min_token_prob: float) -> tuple[list[int], list[float]]:
    tokens, probs, prob = [], [], 1.0
    while len(tokens) < max_tokens and node["children"]:
        token, child = node["children"][0]
        prob *= child["count"] / node["count"]
        if prob < min_token_prob:
            break
        tokens.append(token)
        probs.append(prob)
        node = child
    return tokens, probs


def _leaf(count: int) -> dict:
    return {"count": count, "children": []}


def _hand_cases() -> list[tuple[str, dict, int, float, list[int], list[float]]]:
    # The docstring tree of suffix_tree.py at "a": b (1) then a (1), and c (1).
    a = {"count": 2, "children": [(1, {"count": 1, "children": [(0, _leaf(1))]}), (2, _leaf(1))]}
    chain = {"count": 4, "children": [(7, {"count": 3, "children": [(8, _leaf(1))]}),
                                      (9, _leaf(1))]}
    return [
        ("a tie: the first child listed wins", a, 4, 0.1, [1, 0], [0.5, 0.5]),
        ("the first step already falls below min_token_prob", a, 4, 0.6, [], []),
        ("max_tokens caps the draft", a, 1, 0.1, [1], [0.5]),
        ("a leaf: nothing to draft", _leaf(3), 4, 0.0, [], []),
        ("the product falls below min_token_prob on the second step", chain, 4, 0.3, [7], [0.75]),
        ("min_token_prob 0: walk to the end", chain, 4, 0.0, [7, 8], [0.75, 0.25]),
    ]


def check_walk_suffix_tree(fn: Callable) -> bool:
    """``fn(node, max_tokens, min_token_prob) -> (tokens, probs)``."""
    name = "walk_suffix_tree"
    hand = _hand_cases()
    for case, node, k, p, tokens, probs in hand:
        _check_one(name, fn, case, node, k, p, tokens, probs)
    rng, n_ref = random.Random(0), 200
    for i in range(n_ref):
        tree = SuffixTree(max_depth=rng.randint(3, 8))
        tree.extend(0, [rng.randrange(rng.randint(2, 5)) for _ in range(rng.randint(1, 40))])
        start = rng.choice([tree.root] + tree.root.ranked)
        k, p = rng.randint(1, 6), rng.choice([0.0, 0.12, 0.27, 0.41, 0.66])
        draft = tree.walk(start, k, p)
        _check_one(name, fn, f"random case {i} (vs SuffixTree.walk)", tree_as_dict(start), k, p,
                   draft.token_ids, draft.probs)
    return _passed(name, len(hand), n_ref, "SuffixTree.walk")


def _check_one(name: str, fn: Callable, case: str, node: dict, max_tokens: int,
               min_token_prob: float, tokens: list[int], probs: list[float]) -> None:
    kw = {"node": node, "max_tokens": max_tokens, "min_token_prob": min_token_prob}
    got = _call(name, fn, case, kw)
    shown = {"node": _fmt(node)[:300], "max_tokens": max_tokens, "min_token_prob": min_token_prob}
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        _fail(name, case, shown, (tokens, probs), got, "return a pair: (tokens, probs)")
    got_tokens, got_probs = [int(t) for t in got[0]], [float(x) for x in got[1]]
    if got_tokens != tokens or len(got_probs) != len(probs) or any(
            abs(a - b) > 1e-6 for a, b in zip(got_probs, probs)):
        hint = ""
        if got_tokens[:len(tokens)] == tokens and len(got_tokens) > len(tokens):
            hint = "too long: stop once the running probability is below min_token_prob."
        _fail(name, case, shown, (tokens, probs), (got_tokens, got_probs), hint)
