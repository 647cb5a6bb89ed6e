"""A suffix tree written to be read: what suffix decoding (Oliaro et al., "SuffixDecoding",
arXiv 2411.04975) drafts from.

vLLM 0.32's ``method="suffix"`` (vllm/v1/spec_decode/suffix_decoding.py) keeps its trees in
arctic-inference's C++ ``SuffixTree`` (path-compressed, linear memory). This one is the same tree
without the compression, one node per token, and gives the same drafts and scores.

Every suffix of every sequence in the tree, cut at ``max_depth`` tokens, is a path from the root.
A node's ``count`` is how many of those suffixes pass through it or end at it. The sequence
``a b a c`` with ``max_depth=3`` has the suffixes ``a b a``, ``b a c``, ``a c`` and ``c``::

    root (4)
    |-- a (2)
    |   |-- b (1) -- a (1)
    |   `-- c (1)
    |-- b (1) -- a (1) -- c (1)
    `-- c (1)

Drafting (``speculate``): find the context's last tokens as a path from the root (the match), then
walk on, each time to the child with the highest count. A token's estimated probability is the
product of ``count(child) / count(parent)`` along the walk from the match; the walk stops when it
falls below ``min_token_prob``. For context ``... a`` the match is ``a (2)``; its children ``b (1)``
and ``c (1)`` tie, so ``b`` is drafted with probability 1/2, then ``a`` (1/2 * 1/1).

Ties between children of equal count go the way arctic-inference's sibling list orders them, so
both trees draft the same token: each node keeps its children in a list by decreasing count; a new
child goes last; a child whose count rises moves to the front of its new equal-count run if it
was first in its old run, else to the end of the new run; a child whose count falls moves to the
front of its new run.

Cost: appending a token touches the ends of the sequence's last ``max_depth`` suffixes (at most
``max_depth`` nodes); ``speculate`` matches each suffix length of the context from the root
(at most ``max_depth**2 / 2`` dictionary lookups) and walks at most ``max_spec_tokens`` nodes.
"""
from __future__ import annotations

import bisect
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

_F32 = array("f", [0.0])


def _f32(x: float) -> float:
    """``x`` rounded to float32: arctic-inference computes probabilities and scores in float32.
    One product, quotient or sum of float32 values, computed in float64 and then rounded, is
    exactly the float32 result (float64 has more than twice float32's precision)."""
    _F32[0] = x
    return _F32[0]


@dataclass(eq=False, slots=True)
class Node:
    token: int
    count: int = 0
    children: dict[int, "Node"] = field(default_factory=dict)   # token -> child
    ranked: list["Node"] = field(default_factory=list)          # the children, highest count first


@dataclass
class SuffixDraft:
    """One speculation: ``token_ids[i]`` drafted with estimated probability ``probs[i]``;
    ``score = sum(probs)`` (float32, as arctic-inference sums it); ``match_len``: how many of the
    context's last tokens matched. ``counts[i]``: the ``(count(child), count(parent))`` behind
    each step of the walk, for the tour."""
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    counts: list[tuple[int, int]] = field(default_factory=list)


def _neg_count(node: Node) -> int:
    return -node.count


def _increment(parent: Node, child: Node) -> None:
    """``child.count += 1``, keeping ``parent.ranked`` in arctic-inference's order. ``append``
    bumps a child ranked first (an only child, most often) itself: that one stays first."""
    ranked, c = parent.ranked, child.count
    head = bisect.bisect_left(ranked, -c, key=_neg_count)       # first child with count c
    i = ranked.index(child, head)
    # First of its run: to the front of the count c + 1 run. Otherwise: just before its old
    # run, which is the end of the count c + 1 run.
    new = bisect.bisect_left(ranked, -(c + 1), key=_neg_count) if i == head else head
    ranked.pop(i)
    ranked.insert(new, child)
    child.count += 1


def _decrement(parent: Node, child: Node) -> None:
    """``child.count -= 1``: it moves behind the others of its old count (front of the new run)."""
    ranked, c = parent.ranked, child.count
    if ranked[-1] is child:                 # last already (an only child, most often): stays
        child.count -= 1
        return
    head = bisect.bisect_left(ranked, -c, key=_neg_count)
    end = bisect.bisect_right(ranked, -c, key=_neg_count)       # one past the last with count c
    ranked.pop(ranked.index(child, head))
    ranked.insert(end - 1, child)
    child.count -= 1


class SuffixTree:
    """The suffixes of several sequences (``seq_id -> tokens``), each cut at ``max_depth``."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node(token=-1)
        self.seqs: dict[int, list[int]] = {}
        # Per sequence, the nodes where its last max_depth suffixes end: the next token extends
        # each of them by one child. The oldest one leaves once it is max_depth tokens long.
        self.active: dict[int, deque[Node]] = {}

    def append(self, seq_id: int, token: int) -> None:
        """Extend sequence ``seq_id`` (created on first use) by one token."""
        seq = self.seqs.setdefault(seq_id, [])
        ends = self.active.setdefault(seq_id, deque())
        ends.append(self.root)                  # a new, empty suffix starts at the new token
        self.root.count += 1
        if len(ends) > self.max_depth:
            ends.popleft()
        seq.append(token)
        for i, node in enumerate(ends):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node(token, 1)
                node.ranked.append(child)
            elif node.ranked[0] is child:       # first already (an only child, most often)
                child.count += 1
            else:
                _increment(node, child)
            ends[i] = child

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(seq_id, int(token))

    def remove(self, seq_id: int) -> None:
        """Take every suffix of sequence ``seq_id`` out of the tree (nothing if it is unknown)."""
        seq = self.seqs.pop(seq_id, [])
        self.active.pop(seq_id, None)
        for start in range(len(seq)):
            node = self.root
            node.count -= 1
            for token in seq[start:start + self.max_depth]:
                child = node.children[token]
                if child.count == 1:            # only this suffix passes: drop the branch
                    del node.children[token]
                    node.ranked.remove(child)
                    break
                _decrement(node, child)
                node = child

    def match(self, pattern: Sequence[int]) -> Optional[Node]:
        """The node at the end of the path spelling ``pattern`` from the root, or ``None``."""
        node: Optional[Node] = self.root
        for token in pattern:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> SuffixDraft:
        """The best draft over every match length ``1 .. len(context) - 1``: the highest score,
        the longer match on a tie. A match of ``m`` tokens drafts at most
        ``max_spec_factor * m`` tokens (and at most ``max_spec_tokens``)."""
        context = [int(t) for t in context]
        best, factor = SuffixDraft(), _f32(max_spec_factor)
        for match_len in range(1, len(context)):
            node = self.match(context[len(context) - match_len:])
            if node is None:
                break                           # no longer suffix can match either
            # arctic-inference's cap (suffix_tree.cc, speculate), float32 product and all: the
            # + 1e-6 is its slack against a product that rounds to just under a whole number,
            # which int() would truncate one token short; kept so the caps equal its own.
            cap = int(_f32(match_len * factor) + 1e-6)
            draft = self.walk(node, max(0, min(max_spec_tokens, cap)), min_token_prob)
            if draft.score >= best.score:
                best, best.match_len = draft, match_len
        return best

    def walk(self, node: Node, max_tokens: int, min_token_prob: float) -> SuffixDraft:
        """From ``node``, follow the highest-count child while the running probability stays at
        or above ``min_token_prob``; at most ``max_tokens`` tokens."""
        draft, prob, score, floor = SuffixDraft(), 1.0, 0.0, _f32(min_token_prob)
        tokens, probs, counts = draft.token_ids, draft.probs, draft.counts
        while len(tokens) < max_tokens and node.ranked and prob >= floor:
            child = node.ranked[0]
            if child.count != node.count:       # else a factor of exactly 1: nothing to round
                # Counts (below 2**24) are exact in float32: the quotient and the product are
                # each rounded once, as in float32 arithmetic.
                prob = _f32(prob * _f32(child.count / node.count))
                if prob < floor:
                    break
            score = _f32(score + prob)
            tokens.append(child.token)
            probs.append(prob)
            counts.append((child.count, node.count))
            node = child
        draft.score = score
        return draft

    def draw(self, max_lines: int = 40, decode=str) -> str:
        """The tree as text, one node per line (``token (count)``), children by rank."""
        lines: list[str] = [f"root ({self.root.count})"]

        def visit(node: Node, indent: str) -> None:
            for i, child in enumerate(node.ranked):
                if len(lines) >= max_lines:
                    return
                last = i == len(node.ranked) - 1
                lines.append(f"{indent}{'`-- ' if last else '|-- '}{decode(child.token)} "
                             f"({child.count})")
                visit(child, indent + ("    " if last else "|   "))
        visit(self.root, "")
        return "\n".join(lines)
