"""Checks for the speculative-decoding exercises in ``notebooks/04_exercises.ipynb``.

Each ``check_<name>(student_fn)`` runs the student's function on hand-made cases (expected values
written out below) and on cases answered by minivllm's own implementation, then prints a one-line
pass, or raises ``ExerciseCheckError`` naming the case, its inputs, the expected and the returned
value (and a hint when the mistake is a common one).

| exercise | student writes | checked against |
|---|---|---|
| residual distribution | ``residual_distribution(p_target, p_draft)`` | hand cases; recovered tokens drawn by ``sample_recovered_tokens_torch`` |
| last-match n-gram | ``propose_last_match(context, min_n, max_n, k)`` | hand cases; ``NgramProposer(match="last")`` |
| blocks to allocate | ``num_blocks_to_allocate(num_computed_tokens, num_new_tokens, num_lookahead_tokens, num_held_blocks, block_size, max_model_len)`` | hand cases; ``KVCacheManager.allocate_slots`` |
| spec-decode logits indices | ``spec_decode_logits_indices(num_scheduled_tokens, num_draft_tokens)`` | hand cases; ``ModelRunner._calc_spec_decode_metadata`` |
"""
from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import torch

from minivllm.learn.exercises.registry import ExerciseCheckError, exercise


def _fmt(x: Any) -> str:
    if isinstance(x, (torch.Tensor, np.ndarray, np.generic)):
        x = x.tolist()
    if isinstance(x, float):
        return f"{x:.4f}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in x) + "]"
    return repr(x)


def _call(name: str, fn: Callable, case: str, kwargs: dict[str, Any]) -> Any:
    shown = ", ".join(f"{k}={_fmt(v)}" for k, v in kwargs.items())
    try:
        return fn(**{k: (v.clone() if isinstance(v, torch.Tensor) else
                         list(v) if isinstance(v, list) else v) for k, v in kwargs.items()})
    except NotImplementedError:
        raise ExerciseCheckError(f"{name} is not written yet: replace `raise NotImplementedError` "
                                 "with your code, run its cell, then this check again.") from None
    except Exception as e:   # the student's bug, reported with the input that triggered it
        raise ExerciseCheckError(f"{name} raised {type(e).__name__}: {e}\n  case: {case}\n  "
                                 f"input: {name}({shown})") from e


def _fail(name: str, case: str, kwargs: dict[str, Any], expected: Any, got: Any, hint: str = "") -> None:
    shown = "\n".join(f"    {k} = {_fmt(v)}" for k, v in kwargs.items())
    raise ExerciseCheckError(f"{name} is wrong for case '{case}':\n  input:\n{shown}\n"
                             f"  expected: {_fmt(expected)}\n  got:      {_fmt(got)}"
                             + (f"\n  hint: {hint}" if hint else ""))


def _passed(name: str, n_hand: int, n_ref: int, ref: str) -> bool:
    print(f"\u2713 {name}: {n_hand} hand-made cases and {n_ref} cases against {ref} pass.")
    return True


# --------------------------------------------------------------------------- 1. residual distribution
def _residual_hint(p, q, got) -> str:
    got = torch.as_tensor(got, dtype=torch.float64)
    if torch.isnan(got).any():
        return ("NaN: max(p_target - p_draft, 0) is all zeros here, and 0 / 0 is NaN. The "
                "exercise's convention: when the residual has no mass, return p_target itself.")
    if (got < -1e-9).any():
        return "some entries are negative: clamp p_target - p_draft at 0 before normalising."
    if abs(float(got.sum()) - 1) > 1e-4:
        return f"the entries sum to {float(got.sum()):.4f}: divide by their sum so they sum to 1."
    return ""


def _residual_reference_frequencies(p: torch.Tensor, q: torch.Tensor, draws: int = 20000,
                                    seed: int = 0) -> torch.Tensor:
    """How often minivllm's rejection sampler recovers each token, over ``draws`` independent rows
    with this (p_target, p_draft); the rows share nothing but the two distributions."""
    from minivllm.sample.rejection_torch import sample_recovered_tokens_torch
    gen = torch.Generator().manual_seed(seed)
    vocab = p.numel()
    noise = torch.empty(draws, vocab, dtype=torch.float32).exponential_(generator=gen)
    draft_ids = torch.zeros(draws, dtype=torch.int32)
    tokens = sample_recovered_tokens_torch(draft_ids, q.float().expand(draws, vocab),
                                           p.float().expand(draws, vocab), noise)
    return torch.bincount(tokens.long(), minlength=vocab).double() / draws


@exercise(name="residual_distribution", assignment="spec_decode",
          article_step="Speculative decoding: rejection sampling (the residual distribution)",
          forbidden=('minivllm.sample.rejection_torch:sample_recovered_tokens_torch',),
          mistakes=('no clamp at 0: negative entries', 'not normalised: entries do not sum to 1'))
def check_residual_distribution(fn: Callable, cases: str = "all") -> bool:
    """``fn(p_target, p_draft)``: 1-D float tensors over the vocabulary (each sums to 1) -> the
    distribution a rejected position's recovered token is drawn from: max(p_target - p_draft, 0),
    normalised to sum to 1; when that is all zeros (p_draft == p_target: nothing is ever rejected),
    p_target itself, as the sampler does for a -1 placeholder that drafted nothing."""
    name = "residual_distribution"
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    hand = [
        ("draft too sure of token 1", t(0.5, 0.3, 0.2), t(0.2, 0.5, 0.3), t(1.0, 0.0, 0.0)),
        ("two tokens gain", t(0.4, 0.4, 0.2, 0.0), t(0.1, 0.3, 0.1, 0.5), t(0.6, 0.2, 0.2, 0.0)),
        ("one-hot draft (n-gram): the draft token is removed", t(0.1, 0.6, 0.3), t(0.0, 1.0, 0.0),
         t(0.25, 0.0, 0.75)),
        ("draft equals target: the residual is all zeros, so return p_target", t(0.2, 0.5, 0.3),
         t(0.2, 0.5, 0.3), t(0.2, 0.5, 0.3)),
    ]
    hand = hand if cases != "hidden" else []   # visible: the hand cases; hidden: vs the package
    for case, p, q, expected in hand:
        kw = {"p_target": p, "p_draft": q}
        got = _call(name, fn, case, kw)
        got_t = torch.as_tensor(got, dtype=torch.float64) if got is not None else None
        if got_t is None or got_t.shape != expected.shape or not torch.allclose(got_t, expected,
                                                                                  atol=1e-6):
            _fail(name, case, kw, expected, got, "" if got_t is None or got_t.shape != expected.shape
                  else _residual_hint(p, q, got_t))
    gen = torch.Generator().manual_seed(1)
    n_ref = 4 if cases != "visible" else 0
    for i in range(n_ref):
        p = torch.rand(6, generator=gen, dtype=torch.float64) ** 2
        q = torch.rand(6, generator=gen, dtype=torch.float64) ** 2
        p, q = p / p.sum(), q / q.sum()
        case = f"random case {i}, compared with minivllm's recovered-token sampler (20000 draws)"
        kw = {"p_target": p, "p_draft": q}
        got = _call(name, fn, case, kw)
        freq = _residual_reference_frequencies(p, q, seed=i)
        got_t = torch.as_tensor(got, dtype=torch.float64)
        if got_t.shape != freq.shape or (got_t - freq).abs().max() > 0.02:
            _fail(name, case, kw, freq, got, "expected = frequencies the package's sampler drew; "
                  "they match the true residual to about 0.005. " + _residual_hint(p, q, got_t))
    return _passed(name, len(hand), n_ref, "minivllm's rejection sampler")


# --------------------------------------------------------------------------- 2. last-match n-gram
@exercise(name="propose_last_match", assignment="spec_decode",
          article_step="Speculative decoding: the n-gram drafter",
          forbidden=('minivllm.spec_decode.ngram_proposer:NgramProposer.propose',),
          mistakes=("the first match (vLLM's rule) instead of the last",))
def check_propose_last_match(fn: Callable, cases: str = "all") -> bool:
    """``fn(context, min_n, max_n, k)`` -> up to k tokens that followed the most recent earlier
    occurrence of the context's longest matching suffix n-gram (n from max_n down to min_n); []
    when none matches."""
    from minivllm.spec_decode.ngram_proposer import NgramProposer
    name = "propose_last_match"
    hand = [
        ("two earlier matches: the later one wins", [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 3, 2, [8, 1]),
        ("longer n beats a more recent shorter match", [5, 1, 2, 3, 7, 0, 2, 3, 6, 1, 2, 3], 2, 3, 2,
         [7, 0]),
        ("no n-gram of length >= min_n repeats", [1, 2, 3, 4, 5, 6], 2, 3, 3, []),
        ("k capped by the tokens after the match", [4, 5, 6, 4, 5], 2, 2, 5, [6, 4, 5]),
        ("match overlapping the suffix", [1, 2, 1, 2, 1], 3, 3, 3, [2, 1]),
        ("context shorter than min_n", [7, 7], 3, 4, 2, []),
    ]
    hand = hand if cases != "hidden" else []
    for case, ctx, lo, hi, k, expected in hand:
        kw = {"context": ctx, "min_n": lo, "max_n": hi, "k": k}
        got = _call(name, fn, case, kw)
        if got is None or [int(x) for x in got] != expected:
            hint = ""
            first = NgramProposer(lo, hi, k, match="first").propose(ctx)
            if got is not None and [int(x) for x in got] == first and first != expected:
                hint = "that is the FIRST match (vLLM's rule); the exercise asks for the last one."
            _fail(name, case, kw, expected, got, hint)
    rng = random.Random(0)
    n_ref = 200 if cases != "visible" else 0
    for i in range(n_ref):
        ctx = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        lo = rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 3)
        k = rng.randrange(1, 5)
        expected = NgramProposer(lo, hi, k, match="last").propose(ctx)
        kw = {"context": ctx, "min_n": lo, "max_n": hi, "k": k}
        got = _call(name, fn, f"random case {i} (vs NgramProposer(match='last'))", kw)
        if got is None or [int(x) for x in got] != expected:
            _fail(name, f"random case {i}, answered by NgramProposer(match='last')", kw, expected, got)
    return _passed(name, len(hand), n_ref, "NgramProposer(match='last')")


# --------------------------------------------------------------------------- 3. blocks to allocate
def _allocate_slots_reference(num_computed_tokens: int, num_new_tokens: int, num_lookahead_tokens: int,
                              num_held_blocks: int, block_size: int, max_model_len: int) -> int:
    """Ask a real ``KVCacheManager``: a request holding ``num_held_blocks`` blocks with
    ``num_computed_tokens`` computed calls ``allocate_slots``; count the blocks it hands out."""
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.request import Request
    from minivllm.sampling_params import SamplingParams
    manager = KVCacheManager(num_gpu_blocks=256, block_size=block_size, max_model_len=max_model_len,
                             enable_caching=False)
    request = Request("r", list(range(max(num_computed_tokens + num_new_tokens, 1))),
                      SamplingParams(), eos_token_id=None)
    manager.req_to_blocks["r"] = manager.block_pool.get_new_blocks(num_held_blocks)
    manager.num_cached_block["r"] = 0
    request.num_computed_tokens = num_computed_tokens
    new = manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens)
    return len(new.get_block_ids()[0])


@exercise(name="num_blocks_to_allocate", assignment="spec_decode",
          article_step="Speculative decoding: allocate_slots with lookahead slots",
          forbidden=('minivllm.core.kv_cache_manager:KVCacheManager.allocate_slots',),
          mistakes=('the lookahead slots forgotten', 'not capped at max_model_len'))
def check_num_blocks_to_allocate(fn: Callable, cases: str = "all") -> bool:
    """``fn(num_computed_tokens, num_new_tokens, num_lookahead_tokens, num_held_blocks, block_size,
    max_model_len)`` -> how many new blocks ``allocate_slots`` must take from the free queue."""
    name = "num_blocks_to_allocate"
    hand = [  # (case, computed, new, lookahead, held, block_size, max_model_len, expected)
        ("a 20-token prompt, nothing cached", 0, 20, 0, 0, 16, 1024, 2),
        ("decode step that crosses a block boundary", 16, 1, 0, 1, 16, 1024, 1),
        ("decode step inside the last block", 17, 1, 0, 2, 16, 1024, 0),
        ("verify step: 1 token + 3 drafts", 30, 4, 0, 2, 16, 1024, 1),
        ("draft model: 3 lookahead slots too", 25, 4, 3, 2, 16, 1024, 0),
        ("lookahead slots that spill into a new block", 26, 4, 3, 2, 16, 1024, 1),
        ("capped at max_model_len", 60, 4, 3, 4, 16, 64, 0),
        ("drafts were rejected: the request already holds more than it needs", 20, 1, 0, 3, 16, 1024, 0),
        ("block size 4, a long prefill chunk", 8, 13, 0, 2, 4, 1024, 4),
    ]
    hand = hand if cases != "hidden" else []
    for case, c, n, la, held, bs, mml, expected in hand:
        kw = {"num_computed_tokens": c, "num_new_tokens": n, "num_lookahead_tokens": la,
              "num_held_blocks": held, "block_size": bs, "max_model_len": mml}
        got = _call(name, fn, case, kw)
        if got != expected:
            naive = -(-(c + n + la) // bs) - held
            hint = ""
            if got == naive and naive < 0:
                hint = "a request never gives blocks back here: the answer cannot be negative."
            elif got == naive:
                hint = "slots past max_model_len are never written: cap the token count first."
            elif got == -(-(n + la) // bs):
                hint = "count the blocks needed for ALL tokens up to here, then subtract the held ones."
            elif la and got == max(0, -(-min(c + n, mml) // bs) - held):
                hint = "the lookahead slots need blocks too."
            _fail(name, case, kw, expected, got, hint)
    rng = random.Random(0)
    n_ref = 100 if cases != "visible" else 0
    for i in range(n_ref):
        bs = rng.choice([1, 2, 4, 8, 16])
        c = rng.randrange(0, 80)
        n = rng.randrange(1, 20)
        la = rng.choice([0, 0, 1, 3])
        mml = rng.choice([128, c + n + rng.randrange(0, 3)])
        held = max(0, -(-c // bs) + rng.choice([0, 0, 0, 1]))
        kw = {"num_computed_tokens": c, "num_new_tokens": n, "num_lookahead_tokens": la,
              "num_held_blocks": held, "block_size": bs, "max_model_len": mml}
        expected = _allocate_slots_reference(c, n, la, held, bs, mml)
        got = _call(name, fn, f"random case {i}", kw)
        if got != expected:
            _fail(name, f"random case {i}, answered by KVCacheManager.allocate_slots", kw, expected, got)
    return _passed(name, len(hand), n_ref, "KVCacheManager.allocate_slots")


# --------------------------------------------------------------------------- 4. spec-decode indices
def reference_spec_decode_logits_indices(num_scheduled_tokens: list[int], num_draft_tokens: list[int]):
    """(logits_indices, target_logits_indices, bonus_logits_indices) as minivllm computes them.

    Runs ``ModelRunner._calc_spec_decode_metadata`` on a stand-in runner whose persistent batch holds
    only what that method reads (its token ids do not affect the indices)."""
    from minivllm.worker.model_runner import ModelRunner
    n = len(num_scheduled_tokens)
    width = max(num_draft_tokens, default=0) + 1
    batch = SimpleNamespace(token_ids_cpu=np.zeros((n, width), dtype=np.int64),
                            num_tokens_no_spec=np.zeros(n, dtype=np.int64))
    runner = SimpleNamespace(input_batch=batch, device=torch.device("cpu"))
    md = ModelRunner._calc_spec_decode_metadata(runner, np.asarray(num_draft_tokens),
                                                np.cumsum(num_scheduled_tokens))
    return (md.logits_indices.tolist(), md.target_logits_indices.tolist(),
            md.bonus_logits_indices.tolist())


@exercise(name="spec_decode_logits_indices", assignment="spec_decode",
          article_step="Speculative decoding: the verify step's logits indices",
          forbidden=('minivllm.worker.model_runner:ModelRunner._calc_spec_decode_metadata',),
          mistakes=('target and bonus indices into the hidden-state rows, not the selected '
                    'logits',))
def check_spec_decode_logits_indices(fn: Callable, cases: str = "all") -> bool:
    """``fn(num_scheduled_tokens, num_draft_tokens)`` -> (logits_indices, target_logits_indices,
    bonus_logits_indices) as lists: which rows of the flattened hidden states get logits, and, within
    those selected rows, where each draft's target distribution and each request's bonus sit."""
    name = "spec_decode_logits_indices"
    hand = [
        ("one request verifying 3 drafts", [4], [3], ([0, 1, 2, 3], [0, 1, 2], [3])),
        ("no drafts: one row per request, the last scheduled one", [5, 1], [0, 0], ([4, 5], [], [0, 1])),
        ("a prefill, a 3-draft and a 2-draft request", [5, 4, 3], [0, 3, 2],
         ([4, 5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 5, 6], [0, 4, 7])),
    ]
    hand = hand if cases != "hidden" else []
    for case, sched, drafts, expected in hand:
        kw = {"num_scheduled_tokens": sched, "num_draft_tokens": drafts}
        got = _call(name, fn, case, kw)
        got_l = _as_lists(got)
        if got_l != [list(e) for e in expected]:
            hint = ""
            rows = [[expected[0][j] for j in expected[1]], [expected[0][j] for j in expected[2]]]
            if isinstance(got_l, list) and len(got_l) == 3 and got_l[0] == expected[0] and (
                    got_l[1] == rows[0] or got_l[2] == rows[1]):
                hint = ("target and bonus indices index the SELECTED logits (0 .. "
                        "len(logits_indices) - 1), not the hidden-state rows.")
            _fail(name, case, kw, expected, got, hint)
    rng = random.Random(0)
    n_ref, n_want = 0, 50 if cases != "visible" else 0
    while n_ref < n_want:
        drafts = [rng.choice([0, 1, 2, 3]) for _ in range(rng.randrange(1, 5))]
        if not any(drafts):
            continue   # the model runner builds no spec metadata for a batch without drafts
        sched = [d + 1 if d else rng.randrange(1, 9) for d in drafts]
        kw = {"num_scheduled_tokens": sched, "num_draft_tokens": drafts}
        expected = reference_spec_decode_logits_indices(sched, drafts)
        got = _call(name, fn, f"random case {n_ref}", kw)
        if _as_lists(got) != [list(e) for e in expected]:
            _fail(name, f"random case {n_ref}, answered by ModelRunner._calc_spec_decode_metadata",
                  kw, expected, got)
        n_ref += 1
    return _passed(name, len(hand), n_ref, "ModelRunner._calc_spec_decode_metadata")


def _as_lists(got: Any) -> Any:
    try:
        return [[int(x) for x in (v.tolist() if hasattr(v, "tolist") else v)] for v in got]
    except TypeError:
        return got
