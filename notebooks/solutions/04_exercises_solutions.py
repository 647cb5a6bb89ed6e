"""Solutions to notebooks/04_exercises.ipynb (kept apart from the student notebook).

Each function has the exercise's exact signature; ``python notebooks/solutions/04_exercises_solutions.py``
runs every check. The test suite pastes these bodies into the notebook's exercise cells and runs it.
"""
import torch


def residual_distribution(p_target, p_draft):
    # Where the draft over-proposed, the target has mass left over; that leftover, renormalised, is
    # what a rejected position must be drawn from for the output to follow p_target exactly.
    residual = (p_target - p_draft).clamp_min(0)
    total = residual.sum()
    # p_draft == p_target: nothing is ever rejected and the residual has no mass; the convention
    # (the sampler's, for a placeholder that drafted nothing) is p_target itself, never 0 / 0.
    return residual / total if total > 0 else p_target.clone()


def propose_last_match(context, min_n, max_n, k):
    total = len(context)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = context[total - n:]
        # Latest start first; the occurrence must end before the context's last token.
        for start in range(total - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                follow = start + n
                return list(context[follow:follow + k])
    return []


def num_blocks_to_allocate(num_computed_tokens, num_new_tokens, num_lookahead_tokens,
                           num_held_blocks, block_size, max_model_len):
    num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens,
                               max_model_len)
    num_required_blocks = -(-num_tokens_need_slot // block_size)      # cdiv
    return max(0, num_required_blocks - num_held_blocks)


def spec_decode_logits_indices(num_scheduled_tokens, num_draft_tokens):
    logits_indices, target_logits_indices, bonus_logits_indices = [], [], []
    end = 0          # end of this request's scheduled rows in the flattened hidden states
    selected = 0     # rows of logits selected so far
    for num_sched, num_draft in zip(num_scheduled_tokens, num_draft_tokens):
        end += num_sched
        # The last num_draft + 1 rows: the row before each draft holds that draft's target; the
        # last row gives the bonus distribution.
        logits_indices += list(range(end - num_draft - 1, end))
        target_logits_indices += list(range(selected, selected + num_draft))
        bonus_logits_indices.append(selected + num_draft)
        selected += num_draft + 1
    return logits_indices, target_logits_indices, bonus_logits_indices


if __name__ == "__main__":
    from minivllm.learn import exercises
    exercises.check_residual_distribution(residual_distribution)
    exercises.check_propose_last_match(propose_last_match)
    exercises.check_num_blocks_to_allocate(num_blocks_to_allocate)
    exercises.check_spec_decode_logits_indices(spec_decode_logits_indices)


def walk_suffix_tree(node, max_tokens, min_token_prob):
    tokens, probs, prob = [], [], 1.0
    while len(tokens) < max_tokens and node["children"]:
        token, child = node["children"][0]      # the most frequent child comes first
        prob *= child["count"] / node["count"]
        if prob < min_token_prob:
            break
        tokens.append(token)
        probs.append(prob)
        node = child
    return tokens, probs


if __name__ == "__main__":
    exercises.check_walk_suffix_tree(walk_suffix_tree)
