"""One common mistake per exercise of assignment spec_decode (notebook 04), for the course's
cycle test (tests/test_course.py): the full source of a solution cell with the mistake, and a
substring of the hint the check's message gives for it."""

ANSWERS = {
    "residual_distribution": {
        "mistake": ("def residual_distribution(p_target, p_draft):\n"
                    "    \"\"\"max(p_target - p_draft, 0), normalised to sum to 1.\"\"\"\n"
                    "    return (p_target - p_draft).clamp_min(0)      # not normalised\n"),
        "hint": "divide by their sum",
    },
    "propose_last_match": {
        "mistake": ("def propose_last_match(context, min_n, max_n, k):\n"
                    "    total = len(context)\n"
                    "    for n in range(min(max_n, total - 1), min_n - 1, -1):\n"
                    "        suffix = context[total - n:]\n"
                    "        for start in range(total - n):             # the FIRST match\n"
                    "            if context[start:start + n] == suffix:\n"
                    "                return list(context[start + n:start + n + k])\n"
                    "    return []\n"),
        "hint": "that is the FIRST match",
    },
    "num_blocks_to_allocate": {
        "mistake": ("def num_blocks_to_allocate(num_computed_tokens, num_new_tokens,\n"
                    "                           num_lookahead_tokens, num_held_blocks, block_size,\n"
                    "                           max_model_len):\n"
                    "    tokens = min(num_computed_tokens + num_new_tokens, max_model_len)\n"
                    "    return max(0, -(-tokens // block_size) - num_held_blocks)  # no lookahead\n"),
        "hint": "the lookahead slots need blocks too",
    },
    "spec_decode_logits_indices": {
        "mistake": ("def spec_decode_logits_indices(num_scheduled_tokens, num_draft_tokens):\n"
                    "    logits, target, bonus, end = [], [], [], 0\n"
                    "    for n, d in zip(num_scheduled_tokens, num_draft_tokens):\n"
                    "        end += n\n"
                    "        logits += list(range(end - d - 1, end))\n"
                    "        target += list(range(end - d - 1, end - 1))   # hidden-state rows\n"
                    "        bonus.append(end - 1)\n"
                    "    return logits, target, bonus\n"),
        "hint": "SELECTED logits",
    },
    "walk_suffix_tree": {
        "mistake": ("def walk_suffix_tree(node, max_tokens, min_token_prob):\n"
                    "    tokens, probs = [], []\n"
                    "    while len(tokens) < max_tokens and node[\"children\"]:\n"
                    "        token, child = node[\"children\"][0]\n"
                    "        ratio = child[\"count\"] / node[\"count\"]     # per step, not a product\n"
                    "        if ratio < min_token_prob:\n"
                    "            break\n"
                    "        tokens.append(token)\n"
                    "        probs.append(ratio)\n"
                    "        node = child\n"
                    "    return tokens, probs\n"),
        "hint": "per-step ratios",
    },
}
