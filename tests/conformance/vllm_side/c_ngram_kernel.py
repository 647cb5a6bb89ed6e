"""Case c, vLLM side: vLLM V1's numba n-gram kernels on the test's sequences (no engine).

Input: ``{"cases": [{"tokens", "min_n", "max_n", "k", "max_model_len"}]}``. Output:
``{"single": [[draft ids]], "batch": [[draft ids]]}``: ``single`` from
``_find_longest_matched_ngram_and_propose_tokens`` (the KMP match rule itself), ``batch`` from
``batch_propose_numba`` (the kernel ``NgramProposer.propose`` runs, one call per group of cases
sharing a config, rows laid out as ``token_ids_cpu`` is: ``[num_requests, max_model_len]`` int32).
Rows ``NgramProposer.propose`` never passes to the kernel (``num_tokens >= max_model_len``) come
back as ``None`` in ``batch``.
"""
from collections import defaultdict

import numpy as np
from common import Timer, read_input, write_output
from vllm.v1.spec_decode.ngram_proposer import (_find_longest_matched_ngram_and_propose_tokens,
                                                batch_propose_numba)

if __name__ == "__main__":
    cases = read_input()["cases"]
    timer = Timer()
    single = [_find_longest_matched_ngram_and_propose_tokens(
        np.asarray(c["tokens"], dtype=np.int32), c["min_n"], c["max_n"], c["max_model_len"],
        c["k"]).tolist() for c in cases]

    groups = defaultdict(list)
    for i, c in enumerate(cases):
        groups[(c["min_n"], c["max_n"], c["k"], c["max_model_len"])].append(i)
    batch: list = [None] * len(cases)
    for (min_n, max_n, k, mml), idxs in groups.items():
        width = max(mml, max(len(cases[i]["tokens"]) for i in idxs), 1)
        token_ids_cpu = np.zeros((len(idxs), width), dtype=np.int32)
        num_tokens = np.zeros(len(idxs), dtype=np.int32)
        for row, i in enumerate(idxs):
            toks = cases[i]["tokens"]
            token_ids_cpu[row, :len(toks)] = toks
            num_tokens[row] = len(toks)
        # NgramProposer.propose's filter: rows at (or past) max_model_len are not proposed for.
        valid = [row for row in range(len(idxs)) if num_tokens[row] < mml]
        drafts = np.zeros((len(idxs), k), dtype=np.int32)
        num_drafts = np.zeros(len(idxs), dtype=np.int32)
        if valid:
            batch_propose_numba(valid, num_tokens, token_ids_cpu, min_n, max_n, mml, k, drafts,
                                num_drafts)
        for row, i in enumerate(idxs):
            if row in valid:
                batch[i] = drafts[row, :num_drafts[row]].tolist()
    write_output({"single": single, "batch": batch, "seconds": timer()})
