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

from minivllm.learn.exercises.registry import exercise
from minivllm.learn.exercises.spec import _call, _fail, _fmt, _passed
from minivllm.spec_decode.suffix_tree import SuffixTree


def tree_as_dict(node: Any) -> dict:
    """A ``suffix_tree.Node`` as the exercise's nested dicts."""
    return {"count": node.count, "children": [(c.token, tree_as_dict(c)) for c in node.ranked]}


def _leaf(count: int) -> dict:
    return {"count": count, "children": []}


# The hand-made cases, answers as data: (what the case tests, node, max_tokens, min_token_prob,
# expected tokens, expected probabilities).
_A = {"count": 2, "children": [(1, {"count": 1, "children": [(0, _leaf(1))]}), (2, _leaf(1))]}
_TIE = {"count": 2, "children": [(5, _leaf(1)), (6, _leaf(1))]}
_CHAIN = {"count": 4, "children": [(7, {"count": 3, "children": [(8, _leaf(1))]}), (9, _leaf(1))]}
HAND_CASES: list[tuple[str, dict, int, float, list[int], list[float]]] = [
    ("a tie: of two children seen once each, the first listed wins", _TIE, 4, 0.1, [5], [0.5]),
    ("the running product: 1/2, then a child seen as often as its parent keeps 1/2", _A, 4, 0.1,
     [1, 0], [0.5, 0.5]),
    ("the running product falls below min_token_prob on the second token", _CHAIN, 4, 0.3,
     [7], [0.75]),
    ("min_token_prob 0: walk to the end", _CHAIN, 4, 0.0, [7, 8], [0.75, 0.25]),
    ("a probability exactly min_token_prob is kept (the walk stops only below it)", _A, 4, 0.5,
     [1, 0], [0.5, 0.5]),
    ("the first token already falls below min_token_prob", _A, 4, 0.6, [], []),
    ("max_tokens caps the draft", _A, 1, 0.1, [1], [0.5]),
    ("a leaf: nothing to draft", _leaf(3), 4, 0.0, [], []),
]


def _ratios(node: dict, n: int) -> list[float]:
    """count(child) / count(node) of each of the first ``n`` steps down the first children: what
    a common wrong answer reports instead of the running product."""
    out = []
    while len(out) < n and node["children"]:
        child = node["children"][0][1]
        out.append(child["count"] / node["count"])
        node = child
    return out


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-6 for x, y in zip(a, b))


def _hint(node: dict, max_tokens: int, min_token_prob: float, tokens: list[int],
          probs: list[float], got_tokens: list[int], got_probs: list[float]) -> str:
    """What the usual mistakes look like, said when the answer looks like one."""
    ratios = _ratios(node, len(got_probs))
    if got_probs and _close(got_probs, ratios) and not _close(got_probs, probs[:len(got_probs)]):
        return ("these are per-step ratios count(child) / count(node): a draft token's "
                "probability is the running product of those ratios from the matched node.")
    if (got_tokens == tokens[:len(got_tokens)] and len(got_tokens) < len(tokens)
            and abs(probs[len(got_tokens)] - min_token_prob) < 1e-12):
        return ("stopped at a probability equal to min_token_prob: keep a token while its "
                "probability is >= min_token_prob, stop only below it (`<`, not `<=`).")
    if got_tokens[:len(tokens)] == tokens and len(got_tokens) > len(tokens):
        return "too long: stop once the running probability is below min_token_prob."
    if len(got_tokens) > max_tokens:
        return f"at most max_tokens = {max_tokens} tokens."
    return ""


@exercise(name="walk_suffix_tree", assignment="spec_decode",
          article_step="After the article: suffix decoding's draft (a greedy walk by frequency)",
          forbidden=("minivllm.spec_decode.suffix_tree:SuffixTree.walk",),
          mistakes=("the per-step ratio instead of the running product",
                    "<= instead of < at min_token_prob"))
def check_walk_suffix_tree(fn: Callable, cases: str = "all") -> bool:
    """``fn(node, max_tokens, min_token_prob) -> (tokens, probs)``."""
    name = "walk_suffix_tree"
    hand = HAND_CASES if cases != "hidden" else []
    for case, node, k, p, tokens, probs in hand:
        _check_one(name, fn, case, node, k, p, tokens, probs)
    rng, n_ref = random.Random(0), 200 if cases != "visible" else 0
    for i in range(n_ref):
        tree = SuffixTree(max_depth=rng.randint(3, 8))
        tree.extend(0, [rng.randrange(rng.randint(2, 5)) for _ in range(rng.randint(1, 40))])
        start = rng.choice([tree.root] + tree.root.ranked)
        k, p = rng.randint(1, 6), rng.choice([0.0, 0.12, 0.27, 0.41, 0.66])
        draft = tree.walk(start, k, p)
        _check_one(name, fn, f"random tree {i}: the walk SuffixTree.walk makes", tree_as_dict(start),
                   k, p, draft.token_ids, draft.probs)
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
        hint = _hint(node, max_tokens, min_token_prob, tokens, probs, got_tokens, got_probs)
        _fail(name, case, shown, (tokens, probs), (got_tokens, got_probs), hint)
