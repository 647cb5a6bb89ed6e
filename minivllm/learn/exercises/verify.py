"""Checks for the spec_decode assignment's verify-step exercises (article step 7, "accept/reject
left to right"; vLLM's vllm/v1/sample/rejection_sampler.py and ``Scheduler.update_from_output``):

| exercise | student writes | checked against |
|---|---|---|
| the accept/reject rule with the bonus token | ``accept_reject(draft_token_ids, p_draft, p_target, uniforms, recovered_token_ids, bonus_token_id)`` | hand cases; the "reference" rejection backend's ``accept_or_recover`` on the same draws, with the recovered tokens ``sample_recovered_tokens_torch`` draws |
| what a rejection gives back | ``rejection_gives_back(num_computed_tokens, scheduled_spec_token_ids, sampled_token_ids, num_held_blocks, block_size)`` | a real ``Scheduler``: one prefill, one verify step, ``update_from_output`` |
| block verification (optional) | ``block_verification(draft_token_ids, p_draft, p_target, uniforms)`` | hand cases; the "block" backend's ``joint_ratios_and_thresholds`` and ``block_verify`` |

Each check runs the student's function on hand-made cases (the visible ones in the student's copy,
the ones that catch the common mistakes hidden) and, with the hidden cases, on random cases the
engine answers; a wrong answer raises ``ExerciseCheckError`` naming the case, and a hint when the
answer is what a common mistake gives.
"""
from __future__ import annotations

import math
import random
from typing import Any, Callable, Optional

import torch

from minivllm.learn.exercises.registry import ExerciseCheckError, exercise
from minivllm.learn.exercises.spec import ASSIGNMENT, _call, _done, _fail, _wants, quiet

__all__ = ["check_accept_reject", "check_block_verification", "check_rejection_gives_back"]

_T = torch.float64


def _rows(*rows: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(rows, dtype=_T)


def _ints(got: Any) -> Optional[list[int]]:
    try:
        return [int(x) for x in (got.tolist() if hasattr(got, "tolist") else got)]
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- accept/reject + bonus
def _rule(drafts: list[int], p_draft: torch.Tensor, p_target: torch.Tensor, uniforms: list[float],
          recovered: list[int], bonus: int, accept: Callable[[float, float, float], bool],
          stop: bool = True, add_bonus: bool = True) -> list[int]:
    """The accept/reject loop with a pluggable test ``accept(p_target(x), p_draft(x), u)``: the
    common wrong answers are this loop with one piece changed."""
    out: list[int] = []
    rejected = False
    for j, x in enumerate(drafts):
        if accept(float(p_target[j, x]), float(p_draft[j, x]), uniforms[j]):
            out.append(x)
            continue
        out.append(recovered[j])
        rejected = True
        if stop:
            return out
    return out + [bonus] if add_bonus and not rejected else out


def _right(pt: float, pd: float, u: float) -> bool:
    return pd > 0 and pt / pd >= u


_MISTAKES: list[tuple[str, dict]] = [
    ("every draft was accepted: the bonus token (bonus_token_id, which the target sampled from its "
     "row after the last draft) follows them, k + 1 tokens in all.", {"add_bonus": False}),
    ("stop at the first rejection: its recovered token ends the step's output, and the drafts "
     "after it are not looked at.", {"stop": False}),
    ("u equal to p_target(x) / p_draft(x) is accepted: the rule is p_target(x) / p_draft(x) >= u "
     "(vLLM's kernel), so a draft is rejected only when u is above the ratio.",
     {"accept": lambda pt, pd, u: pd > 0 and pt / pd > u}),
    ("the ratio is p_target(x) / p_draft(x), target over draft: a draft the target likes at least "
     "as much as the drafter did is always accepted.",
     {"accept": lambda pt, pd, u: pt > 0 and pd / pt >= u}),
]


def _accept_hint(kw: dict, got: Optional[list[int]]) -> str:
    args = (kw["draft_token_ids"], kw["p_draft"], kw["p_target"], kw["uniforms"],
            kw["recovered_token_ids"], kw["bonus_token_id"])
    for hint, change in _MISTAKES:
        rule = {"accept": _right, **change}
        if got == _rule(*args, **rule):
            return hint
    accepted = _rule(*args, accept=_right)[:-1]
    j = len(accepted)
    if got is not None and j < len(args[0]) and got == accepted + [args[0][j]]:
        return ("at the first rejection, output recovered_token_ids[j] (drawn from the residual), "
                "not the rejected draft.")
    return ""


def _engine_accept_reject(drafts: list[int], p_draft: torch.Tensor, p_target: torch.Tensor,
                          uniforms: list[float], recovered: list[int], bonus: int) -> list[int]:
    """The rejection sampler's "reference" backend decides (``accept_or_recover``, the rule
    ``rejection_random_sample`` runs per request); the token at the first rejection is the
    recovered token given for that position, as vLLM's kernel outputs it."""
    from minivllm.sample.rejection_reference import accept_or_recover
    accepted, rejected_at = accept_or_recover(drafts, p_draft, p_target, uniforms,
                                              torch.Generator().manual_seed(0))
    if rejected_at is None:
        return accepted + [bonus]
    return accepted + [recovered[len(accepted)]]


def _random_accept_case(rng: torch.Generator) -> dict:
    """k drafts sampled from a random drafter, a random target, the sampler's uniforms, and the
    recovered tokens ``sample_recovered_tokens_torch`` draws from the residuals (Exp(1) noise)."""
    from minivllm.sample.rejection_torch import sample_recovered_tokens_torch
    k = int(torch.randint(1, 5, (), generator=rng))
    vocab = 5
    p_draft = torch.softmax(2 * torch.randn(k, vocab, generator=rng, dtype=_T), -1)
    p_target = torch.softmax(2 * torch.randn(k, vocab, generator=rng, dtype=_T), -1)
    drafts = torch.multinomial(p_draft, 1, generator=rng).view(-1)
    noise = torch.empty(k, vocab, dtype=_T).exponential_(generator=rng)
    recovered = sample_recovered_tokens_torch(drafts, p_draft, p_target, noise)
    return {"draft_token_ids": drafts.tolist(), "p_draft": p_draft, "p_target": p_target,
            "uniforms": torch.rand(k, generator=rng, dtype=_T).tolist(),
            "recovered_token_ids": recovered.tolist(),
            "bonus_token_id": int(torch.randint(vocab, (), generator=rng))}


_RECOVERED = [7, 8, 9]
_ACCEPT_VISIBLE = [
    ("three drafts, the last one rejected", {
        "draft_token_ids": [0, 1, 2],
        "p_draft": _rows((.5, .3, .2), (.2, .6, .2), (.1, .4, .5)),
        "p_target": _rows((.5, .3, .2), (.4, .3, .3), (.6, .3, .1)),
        "uniforms": [.9, .4, .5], "recovered_token_ids": _RECOVERED, "bonus_token_id": 4}),
    ("one draft, rejected: only its recovered token", {
        "draft_token_ids": [1], "p_draft": _rows((.1, .8, .1)), "p_target": _rows((.5, .2, .3)),
        "uniforms": [.6], "recovered_token_ids": [0], "bonus_token_id": 2}),
]
_ACCEPT_HIDDEN = [
    ("every draft accepted: the bonus token follows", {
        "draft_token_ids": [2, 0, 1],
        "p_draft": _rows((.3, .3, .4), (.5, .25, .25), (.2, .6, .2)),
        "p_target": _rows((.2, .2, .6), (.4, .3, .3), (.1, .45, .45)),
        "uniforms": [.3, .7, .5], "recovered_token_ids": _RECOVERED, "bonus_token_id": 5}),
    ("the first draft rejected: stop there, though the later drafts would pass", {
        "draft_token_ids": [0, 1, 2],
        "p_draft": _rows((.8, .1, .1), (.2, .6, .2), (.2, .2, .6)),
        "p_target": _rows((.2, .4, .4), (.1, .8, .1), (.1, .1, .8)),
        "uniforms": [.5, .1, .1], "recovered_token_ids": _RECOVERED, "bonus_token_id": 4}),
    ("u exactly p_target(x) / p_draft(x) = 0.5: accepted", {
        "draft_token_ids": [1, 0],
        "p_draft": _rows((.25, .5, .25), (.5, .25, .25)),
        "p_target": _rows((.5, .25, .25), (.25, .5, .25)),
        "uniforms": [.5, .9], "recovered_token_ids": [6, 7], "bonus_token_id": 3}),
    ("the target likes the draft 4x more than the drafter: accepted whatever u is", {
        "draft_token_ids": [2],
        "p_draft": _rows((.5, .3, .2)), "p_target": _rows((.1, .1, .8)),
        "uniforms": [.95], "recovered_token_ids": [0], "bonus_token_id": 1}),
    ("a one-hot draft (n-gram): p_draft(x) = 1, so accepted iff u <= p_target(x)", {
        "draft_token_ids": [1, 1],
        "p_draft": _rows((0., 1., 0.), (0., 1., 0.)),
        "p_target": _rows((.2, .7, .1), (.5, .3, .2)),
        "uniforms": [.65, .35], "recovered_token_ids": [2, 0], "bonus_token_id": 2}),
]


@exercise(name="accept_reject", assignment=ASSIGNMENT,
          article_step="Speculative decoding step 7: accept/reject left to right, and the bonus "
                       "token (rejection_sampler.py)",
          forbidden=("minivllm.sample.rejection_reference:accept_or_recover",
                     "minivllm.sample.rejection_reference:rejection_sample_one",
                     "minivllm.sample.rejection_reference:ReferenceRejectionBackend."
                     "rejection_random_sample",
                     "minivllm.sample.rejection_torch:random_accept_mask",
                     "minivllm.sample.rejection_torch:accept_left_to_right",
                     "minivllm.sample.rejection_torch:rejection_random_sample_torch",
                     "minivllm.sample.rejection_torch:TorchRejectionBackend."
                     "rejection_random_sample",
                     "minivllm.sample.rejection_sampler:rejection_sample",
                     "minivllm.sample.rejection_sampler:RejectionSampler.forward"),
          mistakes=("no bonus token when every draft is accepted",
                    "going on after the first rejection",
                    "u == p_target / p_draft rejected (`<` where the engine accepts on `>=`)",
                    "the ratio inverted: p_draft / p_target"))
def check_accept_reject(fn: Callable, cases: str = "all") -> None:
    """``fn(draft_token_ids, p_draft, p_target, uniforms, recovered_token_ids, bonus_token_id)`` ->
    the step's output token ids for one request: the accepted drafts, then the recovered token at
    the first rejection, or the bonus token when every draft passed (1 to k + 1 tokens)."""
    name = "accept_reject"
    hand = [(case, kw, None) for case, kw in
            _ACCEPT_VISIBLE * _wants(cases)[0] + _ACCEPT_HIDDEN * _wants(cases)[1]]
    n_ref = 100 if _wants(cases)[1] else 0
    rng = torch.Generator().manual_seed(0)
    with quiet():
        randoms = [(f"random case {i}: drafts sampled from a random drafter, the sampler's "
                    "uniforms and recovered tokens", _random_accept_case(rng), "engine")
                   for i in range(n_ref)]
        for case, kw, _ in hand + randoms:
            expected = _engine_accept_reject(
                kw["draft_token_ids"], kw["p_draft"], kw["p_target"], kw["uniforms"],
                kw["recovered_token_ids"], kw["bonus_token_id"])
            returned = _call(name, fn, case, kw)
            got = _ints(returned)
            if got != expected:
                _fail(name, case, kw, expected, returned if got is None else got,
                      _accept_hint(kw, got))
    _done(name, cases, len(hand), n_ref, "the rejection sampler's reference rule")


# --------------------------------------------------------------------------- rejection gives back
def _scheduler_after_verify(prompt_len: int, drafts: list[int], num_accepted: int,
                            block_size: int) -> dict:
    """A real ``Scheduler``: a ``prompt_len``-token prompt is prefilled and samples one token, the
    drafter proposes ``drafts``, the next step schedules 1 + len(drafts) tokens, and
    ``update_from_output`` gets the accepted drafts and one recovered (or bonus) token. -> the
    student's inputs at that call and the scheduler's answer."""
    from minivllm.config import (CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig,
                                 VllmConfig)
    from minivllm.core.sched.scheduler import Scheduler
    from minivllm.sampling_params import SamplingParams
    from minivllm.worker.outputs import ModelRunnerOutput
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=max(len(drafts), 1),
                             prompt_lookup_min=1, prompt_lookup_max=3)
    config = VllmConfig(ModelConfig(model="fake", max_model_len=4096),
                        CacheConfig(block_size=block_size, enable_prefix_caching=False),
                        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096),
                        speculative_config=spec)
    scheduler = Scheduler(config, num_gpu_blocks=256)
    request = scheduler.make_request("r", list(range(prompt_len)),
                                     SamplingParams(max_tokens=10_000, ignore_eos=True),
                                     eos_token_id=None)
    scheduler.add_request(request)

    def output(tokens: list[int]) -> ModelRunnerOutput:
        return ModelRunnerOutput(["r"], {"r": 0}, [tokens])
    scheduler.update_from_output(scheduler.schedule(), output([1000]))
    scheduler.update_draft_token_ids({"r": drafts})
    scheduler_output = scheduler.schedule()
    pool = scheduler.kv_cache_manager.block_pool
    inputs = {"num_computed_tokens": request.num_computed_tokens,
              "scheduled_spec_token_ids": list(
                  scheduler_output.scheduled_spec_decode_tokens.get("r", [])),
              "sampled_token_ids": drafts[:num_accepted] + [1001],
              "num_held_blocks": len(scheduler.kv_cache_manager.get_block_ids("r")[0]),
              "block_size": block_size}
    free_before = pool.get_num_free_blocks()
    scheduler.update_from_output(scheduler_output, output(inputs["sampled_token_ids"]))
    return {"inputs": inputs, "expected": (request.num_computed_tokens,
                                           pool.get_num_free_blocks() - free_before)}


def _gives_back_hint(kw: dict, got: Any) -> str:
    c, d = kw["num_computed_tokens"], len(kw["scheduled_spec_token_ids"])
    sampled = len(kw["sampled_token_ids"])
    a = sampled - 1
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return "return a pair: (num_computed_tokens, num_blocks_freed)."
    computed, freed = got
    if computed == c - (d - a) and freed:
        return ("no block is freed: the rejected drafts' slots stay allocated to the request and "
                "the next step writes over them.")
    if computed == c - (d - sampled):
        return ("sampled_token_ids holds the accepted drafts and ONE more token (recovered or "
                "bonus): num_accepted = len(sampled_token_ids) - 1.")
    if computed == c - (d - a) - 1:
        return ("only the rejected drafts leave num_computed_tokens; the recovered or bonus token "
                "was never an input this step, so it was never counted.")
    if computed == c - a and a != d - a:
        return "subtract the drafts REJECTED (scheduled - accepted), not the accepted ones."
    return ""


_GIVES_BACK_VISIBLE = [  # (case, prompt_len, drafts, num_accepted, block_size)
    ("2 drafts, 1 accepted", 10, [5, 6], 1, 16),
    ("4 drafts, 2 accepted, blocks of 4", 7, [5, 6, 7, 8], 2, 4),
]
_GIVES_BACK_HIDDEN = [
    ("every draft accepted: nothing to give back", 10, [5, 6, 7], 3, 16),
    ("no draft accepted", 10, [5, 6, 7], 0, 16),
    ("the rejected drafts were alone in the last block: it stays with the request", 7, [5, 6, 7],
     0, 4),
    ("no drafts this step: a plain decode", 10, [], 0, 16),
]


@exercise(name="rejection_gives_back", assignment=ASSIGNMENT,
          article_step="Speculative decoding step 7: update_from_output after a rejection "
                       "(scheduler.py)",
          forbidden=("minivllm.core.sched.scheduler:Scheduler.update_from_output",),
          mistakes=("the accepted drafts subtracted instead of the rejected ones",
                    "blocks freed once the rejected drafts leave them empty",
                    "num_accepted taken as len(sampled_token_ids): the recovered or bonus token "
                    "counted as an accepted draft"))
def check_rejection_gives_back(fn: Callable, cases: str = "all") -> None:
    """``fn(num_computed_tokens, scheduled_spec_token_ids, sampled_token_ids, num_held_blocks,
    block_size)`` -> ``(num_computed_tokens, num_blocks_freed)`` after ``update_from_output``."""
    name = "rejection_gives_back"
    hand = _GIVES_BACK_VISIBLE * _wants(cases)[0] + _GIVES_BACK_HIDDEN * _wants(cases)[1]
    rng = random.Random(0)
    n_ref = 30 if _wants(cases)[1] else 0
    randoms = []
    for i in range(n_ref):
        d = rng.randrange(0, 6)
        randoms.append((f"random case {i}, a real Scheduler's update_from_output",
                        rng.randrange(1, 40), [rng.randrange(50) for _ in range(d)],
                        rng.randrange(0, d + 1), rng.choice([1, 2, 4, 16])))
    with quiet():
        for case, prompt_len, drafts, accepted, block_size in hand + randoms:
            run = _scheduler_after_verify(prompt_len, drafts, accepted, block_size)
            kw, expected = run["inputs"], run["expected"]
            got = _call(name, fn, case, kw)
            try:
                got_t = tuple(int(x) for x in got)
            except (TypeError, ValueError):
                got_t = got
            if got_t != expected:
                _fail(name, case, kw, expected, got, _gives_back_hint(kw, got_t))
    _done(name, cases, len(hand), n_ref, "Scheduler.update_from_output")


# --------------------------------------------------------------------------- block verification
def _block_quantities(drafts: list[int], p_draft: torch.Tensor, p_target: torch.Tensor,
                      uniforms: list[float]) -> tuple[list[float], list[float], int]:
    """The "block" backend's ``(p, h)`` for a two-draft block, and ``block_verify``'s kept length
    on the same uniforms."""
    from minivllm.sample.rejection_block import joint_ratios_and_thresholds
    from minivllm.sample.rejection_reference import block_verify
    p, h = joint_ratios_and_thresholds([len(drafts)], torch.tensor(drafts), p_draft, p_target)
    kept, _ = block_verify(drafts, p_draft, p_target, uniforms, torch.Generator().manual_seed(0))
    return p, h, len(kept)


def _block_variant(drafts, p_draft, p_target, uniforms, cap=True, scale=True, strict=False,
                   first_failure=False, nan=False):
    """The two-draft block's quantities with one piece of the rule changed (for the hints)."""
    (x1, x2), (q1, q2), (t1, t2) = drafts, p_draft, p_target
    p1 = float(t1[x1] / q1[x1])
    p1 = min(p1, 1.0) if cap else p1
    p2 = p1 * float(t2[x2] / q2[x2])
    p2 = min(p2, 1.0) if cap else p2
    mass = float(((p1 if scale else 1.0) * t2 - q2).clamp_min(0).sum())
    denom = mass + 1 - p1
    h1 = mass / denom if denom > 0 else (math.nan if nan else 1.0)
    h = [h1, p2]
    passes = [u < hi if strict else u <= hi for u, hi in zip(uniforms, h)]
    if first_failure:
        tau = 0 if not passes[0] else 1 if not passes[1] else 2
    else:
        tau = 2 if passes[1] else 1 if passes[0] else 0
    return [p1, p2], h, tau


_BLOCK_HINTS = [
    ({"cap": False}, "p_i = min(p_{i-1} * p_target(x_i) / p_draft(x_i), 1): cap each joint ratio "
                     "at 1 before it goes into the next one."),
    ({"scale": False}, "the residual mass after x_1 weighs the target by p_1: m_1 = "
                       "sum_v max(p_1 * p_target(v) - p_draft(v), 0)."),
    ({"nan": True}, "p_1 = 1 and no residual mass is left (m_1 = 0): h_1 = m_1 / (m_1 + 1 - p_1) "
                    "is 0 / 0 there; the rule takes h_1 = 1 (keep the prefix)."),
    ({"strict": True}, "a draw equal to h_i passes: keep the prefix when u_i <= h_i."),
    ({"first_failure": True}, "block verification does not stop at the first failed draw: tau is "
                              "the LONGEST prefix whose draw passes (u_i <= h_i), so a pass at "
                              "i = 2 keeps both drafts even if i = 1 failed."),
]


def _block_hint(kw: dict, got: Any) -> str:
    args = (kw["draft_token_ids"], kw["p_draft"], kw["p_target"], kw["uniforms"])
    expected = _block_variant(*args)
    if not (isinstance(got, tuple) and len(got) == 3
            and all(isinstance(v, list) and len(v) == 2 for v in got[:2])):
        return "return a triple (p, h, tau): [p_1, p_2], [h_1, h_2] and the number of drafts kept."
    if _close(got[1][:1], got[0][:1]) and not _close(expected[1][:1], expected[0][:1]):
        return ("h_1 is not p_1: before the last draft the threshold weighs keeping the prefix "
                "against the residual mass after it, h_1 = m_1 / (m_1 + 1 - p_1).")
    for change, hint in _BLOCK_HINTS:
        variant = _block_variant(*args, **change)
        if _same_block(got, variant) and not _same_block(expected, variant):
            return hint
    return ""


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or abs(x - y) <= 1e-9
                                    for x, y in zip(a, b))


def _same_block(got: Any, expected: tuple) -> bool:
    return (isinstance(got, tuple) and len(got) == 3 and _close(got[0], list(expected[0]))
            and _close(got[1], list(expected[1])) and got[2] == expected[2])


def _as_block(got: Any) -> Any:
    """``(p, h, tau)`` as (list of floats, list of floats, int), or ``got`` as it came."""
    try:
        p, h, tau = got
        as_floats = [[float(x) for x in (v.tolist() if hasattr(v, "tolist") else v)]
                     for v in (p, h)]
        return as_floats[0], as_floats[1], int(tau)
    except (TypeError, ValueError):
        return got


_BLOCK_VISIBLE = [
    ("the worked example: the first draw fails, the second passes, both drafts are kept", {
        "draft_token_ids": [0, 0], "p_draft": _rows((.8, .2), (.5, .5)),
        "p_target": _rows((.4, .6), (.9, .1)), "uniforms": [.7, .6]}),
    ("one-hot drafts: the first draft kept, the second not", {
        "draft_token_ids": [1, 2], "p_draft": _rows((0., 1., 0.), (0., 0., 1.)),
        "p_target": _rows((.3, .5, .2), (.3, .3, .4)), "uniforms": [.3, .5]}),
]
_BLOCK_HIDDEN = [
    ("the target likes x_1 twice as much as the drafter: p_1 = min(2, 1) = 1", {
        "draft_token_ids": [0, 1], "p_draft": _rows((.25, .75), (.5, .5)),
        "p_target": _rows((.5, .5), (.75, .25)), "uniforms": [.9, .7]}),
    ("a draw exactly h_2 = 0.5 passes", {
        "draft_token_ids": [0, 1], "p_draft": _rows((.5, .5), (.5, .5)),
        "p_target": _rows((.5, .5), (.75, .25)), "uniforms": [.99, .5]}),
    ("p_1 = 1 and the target after x_1 is the drafter's: no residual mass, h_1 = 1", {
        "draft_token_ids": [1, 0], "p_draft": _rows((.6, .4), (.3, .7)),
        "p_target": _rows((.4, .6), (.3, .7)), "uniforms": [.5, .5]}),
]


def _random_block_case(rng: torch.Generator) -> dict:
    vocab = 4
    p_draft = torch.softmax(1.5 * torch.randn(2, vocab, generator=rng, dtype=_T), -1)
    p_target = torch.softmax(1.5 * torch.randn(2, vocab, generator=rng, dtype=_T), -1)
    drafts = torch.multinomial(p_draft, 1, generator=rng).view(-1).tolist()
    uniforms = (0.001 + 0.998 * torch.rand(2, generator=rng, dtype=_T)).tolist()
    return {"draft_token_ids": drafts, "p_draft": p_draft, "p_target": p_target,
            "uniforms": uniforms}


@exercise(name="block_verification", assignment=ASSIGNMENT,
          article_step="After the article: block verification, the variant of step 7's rule "
                       "(rejection_sample_method='block'; Sun et al. 2024)",
          forbidden=("minivllm.sample.rejection_reference:block_verify",
                     "minivllm.sample.rejection_block:joint_ratios_and_thresholds",
                     "minivllm.sample.rejection_block:block_residual",
                     "minivllm.sample.rejection_block:BlockRejectionBackend."
                     "rejection_random_sample"),
          mistakes=("the joint ratio not capped at 1",
                    "a draw equal to h_i rejected (`<` instead of `<=`)",
                    "0 / 0 for h_1 when p_1 = 1 and no residual mass is left"),
          optional=True)
def check_block_verification(fn: Callable, cases: str = "all") -> None:
    """``fn(draft_token_ids, p_draft, p_target, uniforms)`` for a block of two drafts ->
    ``(p, h, tau)``: the joint ratios ``[p_1, p_2]``, the thresholds ``[h_1, h_2]`` and the number
    of drafts kept."""
    name = "block_verification"
    hand = [(case, kw) for case, kw in
            _BLOCK_VISIBLE * _wants(cases)[0] + _BLOCK_HIDDEN * _wants(cases)[1]]
    n_ref = 100 if _wants(cases)[1] else 0
    rng = torch.Generator().manual_seed(0)
    with quiet():
        randoms = [(f"random case {i}: two drafts sampled from a random drafter",
                    _random_block_case(rng)) for i in range(n_ref)]
        for case, kw in hand + randoms:
            expected = _block_quantities(kw["draft_token_ids"], kw["p_draft"], kw["p_target"],
                                         kw["uniforms"])
            try:
                got = _as_block(_call(name, fn, case, kw))
            except ExerciseCheckError as e:   # 0 / 0 in Python floats raises
                if not isinstance(e.__cause__, ZeroDivisionError):
                    raise
                raise ExerciseCheckError(f"{e}\n  hint: {_BLOCK_HINTS[2][1]}") from e.__cause__
            if not _same_block(got, expected):
                _fail(name, case, kw, expected, got, _block_hint(kw, got))
    _done(name, cases, len(hand), n_ref, "the block backend's joint_ratios_and_thresholds and "
          "block_verify")
