"""Case b: n-gram speculative decoding against the real vLLM 0.32: the article's config
(k=3, prompt_lookup 3..5) plus k=1 and k=5, greedy float32, the 8 chat prompts x 64 tokens.

- In both engines the outputs equal plain decoding (case a's, ``plain_greedy``).
- vLLM's counters ``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens``
  and ``_num_accepted_tokens_per_pos`` (differences of ``get_metrics()`` around each ``generate``)
  are compared with minivllm's, per request and per batch (all 8 at once, one ``generate``). Per
  request, from that same batch: vLLM's per-request metrics (``per_request_spec_decode_metrics=
  "detailed"``, vllm_side/b_ngram.py) and minivllm's step records (its tracer's verify events);
  in each engine they must add up to its batch counters.

They differ by one thing on purpose (delta row 18): minivllm caps a request's drafts at
``max_tokens - outputs - 1`` (the next step cannot use more); vLLM 0.32 V1 caps them only by
``max_model_len``, so near ``max_tokens`` it drafts (and counts accepting) tokens it then drops.
Both rules are replayed from the plain outputs with the n-gram proposer (identical to vLLM's,
case c): ``replay(cap=True)`` must equal minivllm's counters and ``replay(cap=False)`` vLLM's,
exactly; where the cap never binds the two engines' counters are asserted equal directly.
"""
from __future__ import annotations

import pytest

from minivllm.spec_decode.ngram_proposer import NgramProposer

MAX_TOKENS = 64
LOOKUP = (3, 5)
KS = (3, 1, 5)
NAMES = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
         "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")
ROW18 = ("vLLM 0.32 V1 caps drafts only by max_model_len (v1/spec_decode/ngram_proposer.py); "
         "minivllm also caps them at max_tokens - outputs - 1 (worker/model_runner.py "
         "propose_draft_token_ids): delta row 18")


def replay(prompt: list[int], continuation: list[int], k: int, cap: bool) -> dict:
    """The four counters of one greedy request, from its plain continuation (at least
    ``MAX_TOKENS + k`` long): each step drafts from prompt + outputs so far, accepts drafts while
    they equal the next plain tokens, emits accepted + 1, until ``MAX_TOKENS`` are out."""
    proposer = NgramProposer(*LOOKUP, k, match="first")
    drafts = tokens = accepted = 0
    per_pos = [0] * k
    out = 1                                     # the prefill step samples the first token
    while out < MAX_TOKENS:
        draft = proposer.propose(prompt + continuation[:out])
        if cap:
            draft = draft[:max(0, MAX_TOKENS - out - 1)]
        n = 0
        while n < len(draft) and draft[n] == continuation[out + n]:
            n += 1
        if draft:
            drafts, tokens, accepted = drafts + 1, tokens + len(draft), accepted + n
            for j in range(n):
                per_pos[j] += 1
        out += n + 1
    return dict(zip(NAMES, (drafts, tokens, accepted, per_pos)))


def summed(rows: list[dict]) -> dict:
    total = {n: 0 for n in NAMES[:3]}
    total[NAMES[3]] = [0] * len(rows[0][NAMES[3]])
    for r in rows:
        for n in NAMES[:3]:
            total[n] += r[n]
        total[NAMES[3]] = [a + b for a, b in zip(total[NAMES[3]], r[NAMES[3]])]
    return total


def minivllm_counters(llm) -> dict:
    out = {m.name: getattr(m, "values", getattr(m, "value", None)) for m in llm.get_metrics()}
    return {n: list(out[n]) if n == NAMES[3] else int(out[n]) for n in NAMES}


def minivllm_run(llm, prompts, k: int) -> tuple[dict, list[dict]]:
    """One ``generate`` of all prompts on a fresh engine: the batch's counters (``get_metrics``)
    and each request's, counted from the engine's step records (the tracer's verify events)."""
    from minivllm import SamplingParams
    from minivllm.learn.viz.records import acceptance_from_tracer
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.llm_engine.tracer.enabled = True
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    batch = {"outputs": [list(o.outputs[0].token_ids) for o in outs],
             "counters": minivllm_counters(llm)}
    per_request = []
    for o in outs:
        c = acceptance_from_tracer(llm.llm_engine.tracer, req_id=o.request_id)
        per_pos = c["num_accepted_tokens_per_pos"]
        per_request.append(dict(zip(NAMES, (c["num_drafts"], c["num_draft_tokens"],
                                            c["num_accepted_tokens"],
                                            per_pos + [0] * (k - len(per_pos))))))
    return batch, per_request


@pytest.fixture(scope="module")
def vllm_runs(vllm_side, conformance_model, chat_prompts) -> dict:
    return vllm_side("b_ngram.py", {"model": conformance_model, "prompts": chat_prompts,
                                    "max_tokens": MAX_TOKENS, "ks": list(KS),
                                    "lookup_min": LOOKUP[0], "lookup_max": LOOKUP[1]},
                      timeout=1800)["runs"]   # three engines, one generate each


@pytest.mark.parametrize("k", KS)
def test_b_ngram_outputs_and_counters(k, vllm_runs, plain_greedy, conformance_model,
                                      chat_prompts):
    from minivllm import LLM
    llm = LLM(model=conformance_model, dtype="float32", speculative_config=dict(
        method="ngram", num_speculative_tokens=k, prompt_lookup_min=LOOKUP[0],
        prompt_lookup_max=LOOKUP[1]))
    ours_batch, ours_per_request = minivllm_run(llm, chat_prompts, k)
    theirs = vllm_runs[str(k)]
    plain_ours = [o[:MAX_TOKENS] for o in plain_greedy["minivllm"]]
    plain_theirs = [o[:MAX_TOKENS] for o in plain_greedy["vllm"]]

    # Spec decoding never changes greedy outputs, in either engine.
    assert ours_batch["outputs"] == plain_ours, "minivllm n-gram batch != plain decoding"
    assert theirs["batch"]["outputs"] == plain_theirs, "vLLM n-gram batch != plain decoding"
    assert [r["outputs"][0] for r in theirs["per_request"]] == plain_theirs

    capped, uncapped = [], []
    for i, prompt in enumerate(chat_prompts):
        if plain_greedy["minivllm"][i] != plain_greedy["vllm"][i]:
            continue        # a near-tie split (case a): the replays need one continuation
        capped.append(replay(prompt, plain_greedy["minivllm"][i], k, cap=True))
        uncapped.append(replay(prompt, plain_greedy["vllm"][i], k, cap=False))
        ours, vllm = ours_per_request[i], theirs["per_request"][i]["counters"]
        assert ours == capped[-1], (i, "minivllm's counters != its own rule replayed", ours,
                                    capped[-1])
        assert vllm == uncapped[-1], (i, "vLLM's counters != its rule replayed: " + ROW18, vllm,
                                      uncapped[-1])
        if capped[-1] == uncapped[-1]:
            assert ours == vllm, (i, ours, vllm)
    # Each engine's per-request counts add up to its batch counters (same verify steps).
    assert summed(ours_per_request) == ours_batch["counters"], "minivllm: step records != metrics"
    assert summed([r["counters"] for r in theirs["per_request"]]) == theirs["batch"]["counters"]
    assert len(capped) >= 6, "too many near-tie splits to compare counters"
    if len(capped) == len(chat_prompts):
        assert ours_batch["counters"] == summed(capped), ours_batch["counters"]
        assert theirs["batch"]["counters"] == summed(uncapped), (ROW18, theirs["batch"])
    # The config must actually speculate and accept, or the comparison proves nothing.
    assert ours_batch["counters"][NAMES[2]] > 20
