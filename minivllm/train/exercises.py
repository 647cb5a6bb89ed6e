"""The check for notebook 05's exercise: EAGLE's shifted first-pass inputs.

vLLM ``EagleProposer.propose``: the first draft pass runs over every token the target just
processed (flat batch, request i owns rows ``cu_num_tokens[i]:cu_num_tokens[i+1]``). Position p is
fed token p + 1 (with the target's hidden state at p): shift the flat ids left by one, then put
each request's ``next_token_ids`` entry (the token just sampled) in its last row. Example:
requests a (1 token), b (2), c (3): ``[a1, b1, b2, c1, c2, c3]`` -> ``[a2, b2, b3, c2, c3, c4]``.

``check_eagle_first_pass_inputs(student_fn)`` follows ``minivllm/learn/exercises/spec.py``:
hand-made cases, then random ones against ``reference_eagle_first_pass_inputs``; a clear
``ExerciseCheckError`` naming the case otherwise.
"""
from __future__ import annotations

import random
from typing import Callable

from minivllm.learn.exercises.spec import ExerciseCheckError, _call, _fail, _passed  # noqa: F401


def reference_eagle_first_pass_inputs(input_ids: list[int], cu_num_tokens: list[int],
                                      next_token_ids: list[int]) -> list[int]:
    """The answer, as ``minivllm/spec_decode/eagle.py`` builds it."""
    shifted = list(input_ids[1:]) + [0]
    for end, nxt in zip(cu_num_tokens[1:], next_token_ids):
        shifted[end - 1] = nxt
    return shifted


def check_eagle_first_pass_inputs(fn: Callable) -> bool:
    """``fn(input_ids, cu_num_tokens, next_token_ids)`` -> the draft's first-pass token ids."""
    name = "eagle_first_pass_inputs"
    hand = [
        ("vLLM's example: a1 | b1 b2 | c1 c2 c3 (a=10.., b=20.., c=30..)",
         [11, 21, 22, 31, 32, 33], [0, 1, 3, 6], [12, 23, 34], [12, 22, 23, 32, 33, 34]),
        ("one request, a 4-token prefill", [5, 6, 7, 8], [0, 4], [9], [6, 7, 8, 9]),
        ("two decodes: one token each", [3, 4], [0, 1, 2], [7, 8], [7, 8]),
    ]
    for case, ids, cu, nxt, expected in hand:
        kw = {"input_ids": ids, "cu_num_tokens": cu, "next_token_ids": nxt}
        got = _call(name, fn, case, kw)
        if got is None or [int(x) for x in got] != expected:
            hint = ("the last row of each request must hold its next_token_ids entry, not the "
                    "first token of the next request" if got is not None and len(got) == len(expected)
                    else "return one id per input row")
            _fail(name, case, kw, expected, got, hint)
    rng = random.Random(0)
    n_ref = 5
    for i in range(n_ref):
        lens = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        ids = [rng.randrange(100) for _ in range(cu[-1])]
        nxt = [rng.randrange(100, 200) for _ in lens]
        kw = {"input_ids": ids, "cu_num_tokens": cu, "next_token_ids": nxt}
        expected = reference_eagle_first_pass_inputs(ids, cu, nxt)
        got = _call(name, fn, f"random batch {i}", kw)
        if got is None or [int(x) for x in got] != expected:
            _fail(name, f"random batch {i}", kw, expected, got)
    return _passed(name, len(hand), n_ref, "minivllm's EagleProposer input rule")
