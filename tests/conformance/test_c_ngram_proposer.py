"""Case c: the n-gram proposer alone. vLLM V1's numba kernels (``v1/spec_decode/ngram_proposer.py``:
``_find_longest_matched_ngram_and_propose_tokens`` and ``batch_propose_numba``) against minivllm's
``NgramProposer(match="first")`` on the same token sequences; the drafts must be identical.

About 2,400 sequences: random over tiny vocabularies (many partial matches), periodic ones with noise
(long matches, overlapping the suffix), and hand-written edges: empty and shorter than
``prompt_lookup_min``, ``min == max``, ``max_n`` longer than the context, ``k`` larger than what
follows the match, and contexts at ``max_model_len - 1``, ``max_model_len`` and past it (vLLM's
``propose`` skips those rows; its kernel caps k at ``max_model_len - total``).
No engine: the vLLM side imports the kernels only.
"""
from __future__ import annotations

import random

from minivllm.spec_decode.ngram_proposer import NgramProposer


def _config(rng: random.Random, total: int) -> dict:
    min_n = rng.randint(1, 4)
    max_n = rng.randint(min_n, 6)
    k = rng.randint(1, 6)
    # Half the cases sit at the max_model_len edge: total + {-2 .. 3}.
    mml = total + rng.randint(-2, 3) if rng.random() < 0.5 else 4096
    return dict(min_n=min_n, max_n=max_n, k=k, max_model_len=max(mml, 1))


def make_cases(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for _ in range(600):                       # random, vocabularies of 2..6 tokens
        vocab = rng.randint(2, 6)
        toks = [rng.randrange(vocab) for _ in range(rng.randint(0, 64))]
        cases.append(dict(tokens=toks, **_config(rng, len(toks))))
    for _ in range(600):                       # periodic with noise: long, overlapping matches
        period = [rng.randrange(50) for _ in range(rng.randint(1, 7))]
        toks = (period * 20)[:rng.randint(1, 80)]
        for _ in range(rng.randint(0, 3)):
            if toks:
                toks[rng.randrange(len(toks))] = rng.randrange(50)
        cases.append(dict(tokens=toks, **_config(rng, len(toks))))
    edges = [[], [7], [7, 7], [1, 2, 1, 2, 1], [1, 2, 3, 1, 2, 3], [5] * 10,
             [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [9, 1, 2, 9, 1, 3, 9, 1], list(range(20)) + [3, 4]]
    for toks in edges:                         # every small config on hand-written sequences
        for min_n in (1, 2, 3):
            for max_n in (min_n, min_n + 2, 8):
                for k in (1, 3, 5):
                    for mml in (len(toks) - 1, len(toks), len(toks) + 1, len(toks) + 2, 64):
                        if mml >= 1:
                            cases.append(dict(tokens=toks, min_n=min_n, max_n=max_n, k=k,
                                              max_model_len=mml))
    return cases


def test_c_ngram_drafts_identical(vllm_side):
    cases = make_cases()
    assert len(cases) >= 1000
    theirs = vllm_side("c_ngram_kernel.py", {"cases": cases}, engine=False, timeout=600)
    mismatches = []
    nonempty = 0
    for i, c in enumerate(cases):
        ours = NgramProposer(c["min_n"], c["max_n"], c["k"], max_model_len=c["max_model_len"],
                             match="first").propose(c["tokens"])
        nonempty += bool(ours)
        # The batch kernel as NgramProposer.propose drives it: rows at max_model_len are skipped.
        batch = theirs["batch"][i] if theirs["batch"][i] is not None else []
        if ours != theirs["single"][i] or ours != batch:
            mismatches.append(f"case {i} {c}: minivllm {ours}, vLLM kernel "
                              f"{theirs['single'][i]}, vLLM batch {theirs['batch'][i]}")
    assert not mismatches, f"{len(mismatches)} of {len(cases)} differ:\n" + "\n".join(
        mismatches[:10])
    # The cases must exercise real matches, not only empty drafts.
    assert nonempty > len(cases) // 3, nonempty
