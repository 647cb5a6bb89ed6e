"""Wrong answers to the spec_decode assignment (notebooks/course/source/spec_decode/), for the
course's cycle test and tests/test_exercise_checks.py.

``MISTAKES[name]``: each common mistake as ``Mistake(what, source, hint, visible)``: the full
source of the solution cell with that one mistake (the reference solution, taken from the source
notebook, with one piece changed), the substring of the hint the check shows for it, and whether
the visible cases let it pass (a mistake only the hidden cases catch) or already stop it.
``ANSWERS[name]`` is the first of them, in the contract's form ``{"mistake": source, "hint":
substring}``.
"""
from __future__ import annotations

from typing import NamedTuple

from minivllm.learn.exercises.course import solutions

REFERENCE = solutions("spec_decode")


class Mistake(NamedTuple):
    what: str
    source: str
    hint: str
    visible: bool     # True: the visible cases pass it, only the hidden ones catch it


def _swap(name: str, *pairs: tuple[str, str]) -> str:
    """The reference solution of ``name`` with each ``old`` text (found exactly once) replaced."""
    source = REFERENCE[name]
    for old, new in pairs:
        assert source.count(old) == 1, (name, old)
        source = source.replace(old, new)
    return source


MISTAKES: dict[str, list[Mistake]] = {
    "propose_last_match": [
        Mistake("the most recent match of any length (a shorter, later one beats a longer one)",
                '''def propose_last_match(context, min_n, max_n, k):
    total = len(context)
    for end in range(total - 1, 0, -1):          # the latest occurrence first, whatever n
        for n in range(max_n, min_n - 1, -1):
            if n <= end and n < total and context[end - n:end] == context[total - n:]:
                return list(context[end:end + k])
    return []
''', "a longer n-gram wins over a more recent shorter one", True),
        Mistake("an occurrence may not overlap the suffix",
                _swap("propose_last_match", ("range(total - n - 1, -1, -1)",
                                             "range(total - 2 * n, -1, -1)")),
                "may overlap the suffix itself", True),
        Mistake("the first match (vLLM's rule)",
                _swap("propose_last_match", ("range(total - n - 1, -1, -1)",
                                             "range(0, total - n)")),
                "that is the FIRST match", False),
    ],
    "num_blocks_to_allocate": [
        Mistake("no cap at max_model_len",
                _swap("num_blocks_to_allocate", (
                    "min(num_computed_tokens + num_new_tokens + num_lookahead_tokens,\n"
                    "                               max_model_len)",
                    "num_computed_tokens + num_new_tokens + num_lookahead_tokens")),
                "slots past max_model_len are never written", True),
        Mistake("the lookahead slots left out",
                _swap("num_blocks_to_allocate", (
                    "num_new_tokens + num_lookahead_tokens,", "num_new_tokens,")),
                "the lookahead slots need blocks too", True),
        Mistake("a negative count",
                _swap("num_blocks_to_allocate", (
                    "max(0, num_required_blocks - num_held_blocks)",
                    "num_required_blocks - num_held_blocks")),
                "cannot be negative", True),
    ],
    "spec_decode_logits_indices": [
        Mistake("target and bonus indices as hidden-state rows",
                _swap("spec_decode_logits_indices",
                      ("list(range(selected, selected + num_draft))",
                       "list(range(end - num_draft - 1, end - 1))"),
                      ("bonus_logits_indices.append(selected + num_draft)",
                       "bonus_logits_indices.append(end - 1)")),
                "SELECTED logits", True),
        Mistake("a request without drafts gets all its rows",
                _swap("spec_decode_logits_indices",
                      ("list(range(end - num_draft - 1, end))",
                       "list(range(end - num_sched, end))"),
                      ("list(range(selected, selected + num_draft))",
                       "list(range(selected + num_sched - num_draft - 1,\n"
                       "                                        selected + num_sched - 1))"),
                      ("bonus_logits_indices.append(selected + num_draft)",
                       "bonus_logits_indices.append(selected + num_sched - 1)"),
                      ("selected += num_draft + 1", "selected += num_sched")),
                "gets logits for its last row only", True),
    ],
    "accept_reject": [
        Mistake("no bonus token when every draft is accepted",
                _swap("accept_reject", ("return output + [bonus_token_id]", "return output")),
                "the bonus token (bonus_token_id", True),
        Mistake("going on after the first rejection",
                _swap("accept_reject",
                      ("        return output\n", ""),
                      ("    return output + [bonus_token_id]",
                       "    if output == list(draft_token_ids):\n"
                       "        output.append(bonus_token_id)\n"
                       "    return output")),
                "stop at the first rejection", True),
        Mistake("u equal to the ratio rejected (`<`)",
                _swap("accept_reject", (">= uniforms[j]", "> uniforms[j]")),
                "u equal to p_target(x) / p_draft(x) is accepted", True),
        Mistake("the ratio inverted",
                _swap("accept_reject", ("p_target[j, x] / p_draft[j, x] >= uniforms[j]",
                                        "p_draft[j, x] / p_target[j, x] >= uniforms[j]")),
                "target over draft", False),
        Mistake("the rejected draft output instead of the recovered token",
                _swap("accept_reject", ("output.append(recovered_token_ids[j])",
                                        "output.append(x)")),
                "not the rejected draft", False),
    ],
    "residual_distribution": [
        Mistake("0 / 0 when p_draft == p_target",
                _swap("residual_distribution", (
                    "return residual / total if total > 0 else p_target.clone()",
                    "return residual / total")),
                "return p_target itself", True),
        Mistake("no clamp at 0",
                _swap("residual_distribution", ("(p_target - p_draft).clamp_min(0)",
                                                "(p_target - p_draft)")),
                "clamp p_target - p_draft at 0", False),
        Mistake("the difference the wrong way round",
                _swap("residual_distribution", ("(p_target - p_draft).clamp_min(0)",
                                                "(p_draft - p_target).clamp_min(0)")),
                "that is max(p_draft - p_target, 0)", False),
    ],
    "rejection_gives_back": [
        Mistake("the blocks the rejected drafts leave empty are freed",
                _swap("rejection_gives_back", (
                    "return num_computed_tokens - num_rejected, 0",
                    "num_computed_tokens -= num_rejected\n"
                    "    return num_computed_tokens, num_held_blocks - -(-num_computed_tokens "
                    "// block_size)")),
                "no block is freed", True),
        Mistake("the accepted drafts subtracted",
                _swap("rejection_gives_back", ("return num_computed_tokens - num_rejected, 0",
                                               "return num_computed_tokens - num_accepted, 0")),
                "subtract the drafts REJECTED", True),
        Mistake("num_accepted = len(sampled_token_ids)",
                _swap("rejection_gives_back", ("len(sampled_token_ids) - 1",
                                               "len(sampled_token_ids)")),
                "num_accepted = len(sampled_token_ids) - 1", False),
        Mistake("the recovered or bonus token rolled back too",
                _swap("rejection_gives_back", ("return num_computed_tokens - num_rejected, 0",
                                               "return num_computed_tokens - num_rejected - 1, 0")),
                "was never an input this step", False),
    ],
    "dynamic_k": [
        Mistake("a batch size no range covers gets num_speculative_tokens",
                '''def dynamic_k(schedule, num_speculative_tokens, batch_size):
    for start, end, range_k in schedule:
        if start <= batch_size <= end:
            return min(range_k, num_speculative_tokens)
    return num_speculative_tokens
''', "not num_speculative_tokens", True),
        Mistake("a batch size no range covers gets 0",
                '''def dynamic_k(schedule, num_speculative_tokens, batch_size):
    for start, end, range_k in schedule:
        if start <= batch_size <= end:
            return min(range_k, num_speculative_tokens)
    return 0
''', "keeps the k of the range before it, not 0", True),
        Mistake("no clamp at num_speculative_tokens",
                _swap("dynamic_k", ("k = min(range_k, num_speculative_tokens)", "k = range_k")),
                "clamped to num_speculative_tokens", True),
        Mistake("the ranges in the order listed",
                _swap("dynamic_k", ("in sorted(schedule):", "in schedule:"),
                      ("            break", "            continue")),
                "take them by their start", True),
    ],
    "walk_suffix_tree": [
        Mistake("each token's own ratio instead of the running product",
                _swap("walk_suffix_tree", ("prob *= child", "prob = child")),
                "these are per-step ratios", True),
        Mistake("a probability equal to min_token_prob dropped",
                _swap("walk_suffix_tree", ("if prob < min_token_prob",
                                           "if prob <= min_token_prob")),
                "stopped at a probability equal", True),
    ],
    "block_verification": [
        Mistake("the joint ratio not capped at 1",
                _swap("block_verification",
                      ("p1 = min(float(p_target[0, x1] / p_draft[0, x1]), 1.0)",
                       "p1 = float(p_target[0, x1] / p_draft[0, x1])"),
                      ("p2 = min(p1 * float(p_target[1, x2] / p_draft[1, x2]), 1.0)",
                       "p2 = p1 * float(p_target[1, x2] / p_draft[1, x2])")),
                "cap each joint ratio at 1", True),
        Mistake("a draw equal to h_i rejected",
                _swap("block_verification", ("uniforms[i - 1] <= h[i - 1]",
                                             "uniforms[i - 1] < h[i - 1]")),
                "a draw equal to h_i passes", True),
        Mistake("0 / 0 for h_1",
                _swap("block_verification", (
                    "mass / (mass + 1 - p1) if mass + 1 - p1 > 0 else 1.0",
                    "mass / (mass + 1 - p1)")),
                "the rule takes h_1 = 1", True),
        Mistake("stop at the first failed draw",
                _swap("block_verification", ("            tau = i                  # the longest "
                                             "prefix whose draw passes",
                                             "            tau = i\n"
                                             "        else:\n"
                                             "            break")),
                "does not stop at the first failed draw", False),
        Mistake("the residual mass not weighed by p_1",
                _swap("block_verification", ("(p1 * p_target[1] - p_draft[1])",
                                             "(p_target[1] - p_draft[1])")),
                "weighs the target by p_1", False),
        Mistake("h_1 = p_1, the token-wise threshold",
                _swap("block_verification", (
                    "mass / (mass + 1 - p1) if mass + 1 - p1 > 0 else 1.0", "p1")),
                "h_1 is not p_1", False),
    ],
}

ANSWERS = {name: {"mistake": mistakes[0].source, "hint": mistakes[0].hint}
           for name, mistakes in MISTAKES.items()}
