"""The checks of the assignment ``pd_at_scale``: what the fleet (``minivllm/disagg/fleet/``,
notebook 06's last sections) decides before a request reaches an engine. Source notebook:
``notebooks/course/source/pd_at_scale/09_pd_at_scale_exercises.ipynb``; the student's copy, as
nbgrader releases it: ``notebooks/09_pd_at_scale_exercises.ipynb``.

1. the prefix-cache block hashes: ``block_hashes(token_ids, block_size, cache_salt=None)``, against
   a ``Request``'s hashes from ``kv_cache_utils.get_request_block_hasher`` (vLLM's
   ``vllm/v1/core/kv_cache_utils.py``) and the fleet's ``kv_index.prompt_block_hashes``, with
   what the fleet's ``KVIndex.prefix_blocks`` matches of a wrong answer;
2. the router's score and pick: ``pick_replica(prompt_hashes, replicas, weight=1.0)``, against
   ``kv_index.KVIndex.prefix_blocks``, ``kv_index.score`` and ``kv_index.pick`` (NVIDIA Dynamo's
   KV router cost);
3. the decode-first P/D decision: ``needs_remote_prefill(num_prompt_tokens, cached_blocks,
   block_size, pd_min_uncached_tokens)``, against ``kv_index.needs_remote_prefill`` (llm-d's
   prefix-based P/D decider).

The fleet's functions are imported inside the checks: kv_index.py needs no Ray, and importing
``minivllm.learn.exercises`` imports no part of the fleet.
"""
from __future__ import annotations

import random
from typing import Any, Callable, Optional

from minivllm.learn.exercises.registry import ExerciseCheckError, exercise
from minivllm.learn.exercises.spec import _call, _fail

KV_INDEX = "minivllm.disagg.fleet.kv_index"


# --------------------------------------------------------------------------- 1. block hashes
def _engine_hashes(token_ids: list[int], block_size: int, cache_salt: Optional[str]) -> list[bytes]:
    """The hashes the engine's prefix cache gives a request with this prompt: a ``Request``,
    hashed by ``get_request_block_hasher`` as ``Request.__init__`` does."""
    from minivllm.core.kv_cache_utils import get_request_block_hasher
    from minivllm.request import Request
    from minivllm.sampling_params import SamplingParams
    request = Request("exercise", token_ids, SamplingParams(max_tokens=1), eos_token_id=None)
    if cache_salt is not None:
        request.cache_salt = cache_salt
    return get_request_block_hasher(block_size)(request)


def _short(h: Any) -> Any:
    return h.hex()[:8] if isinstance(h, (bytes, bytearray)) else h


def _hash_hint(got: Any, want: list[bytes], token_ids: list[int], block_size: int,
               cache_salt: Optional[str]) -> str:
    from minivllm.core.kv_cache_utils import NONE_HASH, hash_block_tokens
    if not isinstance(got, (list, tuple)):
        return "return a list of hashes (bytes), one per full block."
    if len(got) == len(want) + 1:
        return ("the last block is partial: only full blocks are hashed (and cached), "
                f"len(token_ids) // block_size = {len(want)} of them.")
    if len(got) != len(want):
        return f"one hash per full block: len(token_ids) // block_size = {len(want)}."
    blocks = [token_ids[i * block_size:(i + 1) * block_size] for i in range(len(want))]
    salt = (("cache_salt", cache_salt),) if cache_salt else None
    unchained = [hash_block_tokens(None, b, salt if i == 0 else None) for i, b in enumerate(blocks)]
    if len(want) > 1 and list(got) == unchained:
        return ("each block's hash is computed from its parent's (the previous block's hash): "
                "equal hashes must mean equal prefixes, not only equal blocks.")
    for seed in (b"", bytes(32), b"\0", hash_block_tokens(None, [], None)):
        if got and got[0] == hash_block_tokens(seed, blocks[0], salt):
            return ("the first block has no parent: pass None as its parent hash, and "
                    "hash_block_tokens uses the seed NONE_HASH, as the engine does.")
    if got and got[0] == NONE_HASH:
        return "NONE_HASH is the first block's parent, not its hash."
    if cache_salt and len(want) > 1 and got[0] == want[0]:
        return ("the cache salt is an extra key of the first block only (the chain carries it to "
                "the others): (('cache_salt', cache_salt),) for block 0, None after.")
    if cache_salt and got and got[0] != want[0] and got[0] == hash_block_tokens(None, blocks[0]):
        return ("the cache salt is missing: the first block's extra keys are "
                "(('cache_salt', cache_salt),).")
    return ""


BLOCK_HASH_CASES = {   # (case, token_ids, block_size, cache_salt)
    "visible": [
        ("two full blocks of 4", [1, 2, 3, 4, 5, 6, 7, 8], 4, None),
        ("one block of 16, the article's block size", list(range(16)), 16, None),
    ],
    "hidden": [
        ("three full blocks and a partial one", list(range(10, 24)), 4, None),
        ("shorter than a block: nothing to hash", [5, 6, 7], 4, None),
        ("two equal blocks: their hashes differ by their parents", [9, 9, 9, 9] * 2, 4, None),
        ("with a cache salt: in the first block's extra keys", list(range(30, 42)), 4, "tenant-a"),
    ],
}


@exercise(name="block_hashes", assignment="pd_at_scale",
          article_step="Prefix caching: the block hash, hash(parent hash, block tokens, extra "
                       "keys), as the fleet's KV index matches it",
          forbidden=("minivllm.core.kv_cache_utils:get_request_block_hasher",
                     "minivllm.core.kv_cache_utils:generate_block_hash_extra_keys",
                     f"{KV_INDEX}:prompt_block_hashes",
                     "minivllm.learn.exercises.scale:_engine_hashes"),
          mistakes=("the last, partial block hashed", "the parent hash not chained (every block "
                    "hashed from None)", "a wrong seed for the first block (b'' instead of None: "
                    "hash_block_tokens seeds None with NONE_HASH)",
                    "the cache salt put into every block, not the first only"))
def check_block_hashes(fn: Callable, cases: str = "all") -> None:
    """``fn(token_ids, block_size, cache_salt=None)`` -> the hashes of the full blocks, each from
    its parent's: equal to the engine's ``Request.block_hashes``, and found by the fleet's
    ``KVIndex`` holding the engine's hashes."""
    from minivllm.disagg.fleet.kv_index import KVIndex, prompt_block_hashes
    name = "block_hashes"
    hand = [c for part in ("visible", "hidden") if cases in (part, "all")
            for c in BLOCK_HASH_CASES[part]]
    rng = random.Random(3)
    n_ref = 12 if cases != "visible" else 0
    for i in range(n_ref):
        bs = rng.choice([1, 2, 4, 16])
        hand.append((f"random #{i}", [rng.randrange(1000) for _ in range(rng.randint(0, 70))], bs,
                     rng.choice([None, None, f"salt-{i}"])))
    for case, token_ids, bs, salt in hand:
        kw = dict(token_ids=token_ids, block_size=bs, cache_salt=salt)
        want = _engine_hashes(token_ids, bs, salt)
        if salt is None and prompt_block_hashes(token_ids, bs) != want:
            raise ExerciseCheckError(f"{name}, case '{case}': the fleet's hashes disagree with "
                                     "the engine's (a fault of the package, not of your answer).")
        got = _call(name, fn, case, kw)
        if not isinstance(got, (list, tuple)) or list(got) != want:
            # What the fleet would make of these hashes: its index holds the engine's.
            index = KVIndex()
            index.apply("decode-0", [_Stored(block_hashes=want)])
            matched = (index.prefix_blocks("decode-0", list(got))
                       if isinstance(got, (list, tuple)) else 0)
            hint = _hash_hint(got, want, token_ids, bs, salt)
            _fail(name, case, kw, [_short(h) for h in want],
                  [_short(h) for h in got] if isinstance(got, (list, tuple)) else got,
                  (hint + "\n  " if hint else "") + f"(the fleet's KV index, holding the "
                  f"engine's {len(want)} hashes of this prompt, matches {matched} of yours.)")
    print(f"\u2713 {name}: {len(hand) - n_ref} hand-made cases"
          + (f" and {n_ref} random prompts" if n_ref else "")
          + " hash as the engine's prefix cache does, and the fleet's KV index matches them.")


class _Stored:
    """A ``BlockStored`` KV event as ``KVIndex.apply`` reads it (its class name, its hashes)."""

    def __init__(self, block_hashes: list) -> None:
        self.block_hashes = block_hashes


_Stored.__name__ = "BlockStored"


# --------------------------------------------------------------------------- 2. score and pick
def _reference_pick(prompt_hashes: list, replicas: dict, weight: float) -> tuple[Any, dict]:
    """(the replica the fleet picks, {replica: its score}): a ``KVIndex`` fed with each replica's
    blocks, its ``prefix_blocks``, then ``pick`` over the replicas in id order (as
    ``PoolView.choose``)."""
    from minivllm.disagg.fleet.kv_index import Candidate, KVIndex, pick
    index = KVIndex()
    for r, state in replicas.items():
        index.apply(r, [_Stored(block_hashes=list(state["held"]))])
    candidates = [Candidate(r, index.prefix_blocks(r, prompt_hashes),
                            replicas[r]["blocks_in_use"], replicas[r]["num_ongoing"])
                  for r in sorted(replicas)]
    best = pick(candidates, len(prompt_hashes), weight)
    return (best.replica if best else None), {c.replica: c.score for c in candidates}


def _pick_hint(got: Any, want: tuple[Any, dict], prompt_hashes: list, replicas: dict,
               weight: float) -> str:
    try:
        got_pick, got_scores = got
        got_scores = {r: float(s) for r, s in dict(got_scores).items()}
    except (TypeError, ValueError):
        return "return (the replica id picked, {replica id: its score})."
    want_pick, want_scores = want
    n = len(prompt_hashes)
    inter = {r: weight * (n - len(set(prompt_hashes) & set(s["held"]))) + s["blocks_in_use"]
             for r, s in replicas.items()}
    if got_scores != want_scores:
        if got_scores == inter:
            return ("a replica's prefix cache can use only a prefix: count its blocks from the "
                    "prompt's first, and stop at the first it does not hold.")
        if set(got_scores) != set(want_scores):
            return "one score per replica, the replicas' ids as keys."
        return ("the score is overlap_score_weight * (prompt blocks - prefix blocks held) + "
                "blocks in use: the blocks it would still prefill, weighted, plus its load.")
    if got_pick != want_pick:
        best = min(want_scores.values())
        if list(want_scores.values()).count(best) > 1:
            return ("the scores tie: the fewest requests in flight wins, then the fewest blocks "
                    "in use, then the lowest replica id.")
        return "the lowest score wins."
    return ""


PICK_CASES = {   # (case, prompt_hashes, {replica: held, blocks_in_use, num_ongoing}, weight)
    "visible": [
        ("d1 holds the prompt's first two blocks", ["a0", "a1", "a2", "a3"],
         {"d0": dict(held={"x0"}, blocks_in_use=0, num_ongoing=0),
          "d1": dict(held={"a0", "a1"}, blocks_in_use=0, num_ongoing=0)}, 1.0),
        ("d0 holds the whole prompt but carries a heavy load", ["a0", "a1", "a2"],
         {"d0": dict(held={"a0", "a1", "a2"}, blocks_in_use=9, num_ongoing=3),
          "d1": dict(held=set(), blocks_in_use=1, num_ongoing=1)}, 1.0),
        ("no replica", ["a0"], {}, 1.0),
    ],
    "hidden": [
        ("d1 holds blocks 0, 1 and 3: its prefix is 2 blocks", ["a0", "a1", "a2", "a3"],
         {"d0": dict(held={"a0", "a1", "a2"}, blocks_in_use=1, num_ongoing=1),
          "d1": dict(held={"a0", "a1", "a3"}, blocks_in_use=0, num_ongoing=0)}, 1.0),
        ("d0 holds only a later block: no prefix", ["a0", "a1", "a2"],
         {"d0": dict(held={"a2"}, blocks_in_use=0, num_ongoing=0),
          "d1": dict(held=set(), blocks_in_use=1, num_ongoing=0)}, 1.0),
        ("an empty index: every score ties, the fewest requests in flight wins",
         ["a0", "a1"],
         {"d0": dict(held=set(), blocks_in_use=4, num_ongoing=2),
          "d1": dict(held=set(), blocks_in_use=4, num_ongoing=1),
          "d2": dict(held=set(), blocks_in_use=4, num_ongoing=2)}, 1.0),
        ("equal scores and requests: the fewest blocks in use wins", ["a0", "a1", "a2"],
         {"d0": dict(held={"a0", "a1"}, blocks_in_use=5, num_ongoing=1),
          "d1": dict(held={"a0"}, blocks_in_use=3, num_ongoing=1)}, 2.0),
        ("a full tie: the lowest replica id", ["a0"],
         {"d2": dict(held=set(), blocks_in_use=0, num_ongoing=0),
          "d1": dict(held=set(), blocks_in_use=0, num_ongoing=0)}, 1.0),
        ("overlap_score_weight 3: the cache counts three times a block of load",
         ["a0", "a1", "a2", "a3"],
         {"d0": dict(held={"a0", "a1", "a2"}, blocks_in_use=5, num_ongoing=1),
          "d1": dict(held=set(), blocks_in_use=0, num_ongoing=0)}, 3.0),
    ],
}


def _shown_replicas(replicas: dict) -> dict:
    return {r: dict(s, held=sorted(s["held"], key=str)) for r, s in replicas.items()}


@exercise(name="pick_replica", assignment="pd_at_scale",
          article_step="P/D at scale (after the article): KV-aware routing, NVIDIA Dynamo's "
                       "router cost and its tie-break",
          forbidden=(f"{KV_INDEX}:score", f"{KV_INDEX}:pick", f"{KV_INDEX}:KVIndex.prefix_blocks",
                     "minivllm.learn.exercises.scale:_reference_pick"),
          mistakes=("the overlap counted as every prompt block the replica holds, not the prefix "
                    "from the first block (a prefix cache can only use a prefix)",
                    "ties broken by the replicas' order, not by the fewest requests in flight, "
                    "then the fewest blocks in use",
                    "overlap_score_weight applied to the load, or to the blocks held instead of "
                    "the blocks still to prefill"))
def check_pick_replica(fn: Callable, cases: str = "all") -> None:
    """``fn(prompt_hashes, replicas, weight=1.0)`` -> (replica id or None, {replica: score}),
    against the fleet's ``KVIndex.prefix_blocks``, ``score`` and ``pick``."""
    name = "pick_replica"
    hand = [c for part in ("visible", "hidden") if cases in (part, "all")
            for c in PICK_CASES[part]]
    rng = random.Random(5)
    n_ref = 20 if cases != "visible" else 0
    for i in range(n_ref):
        prompt = [f"b{j}" for j in range(rng.randint(0, 8))]
        replicas = {f"d{r}": dict(held={h for h in prompt + ["z0", "z1"] if rng.random() < 0.6},
                                  blocks_in_use=rng.randint(0, 6), num_ongoing=rng.randint(0, 2))
                    for r in rng.sample(range(6), rng.randint(1, 4))}
        hand.append((f"random #{i}", prompt, replicas, rng.choice([0.5, 1.0, 2.0])))
    for case, prompt_hashes, replicas, weight in hand:
        kw = dict(prompt_hashes=prompt_hashes, replicas=replicas, weight=weight)
        want = _reference_pick(prompt_hashes, replicas, weight)
        got = _call(name, fn, case, kw)
        try:
            same = got[0] == want[0] and {r: float(s) for r, s in dict(got[1]).items()} == want[1]
        except (TypeError, ValueError, IndexError, KeyError):
            same = False
        if not same:
            _fail(name, case, dict(kw, replicas=_shown_replicas(replicas)), want, got,
                  _pick_hint(got, want, prompt_hashes, replicas, weight))
    print(f"\u2713 {name}: {len(hand) - n_ref} hand-made cases"
          + (f" and {n_ref} random ones" if n_ref else "")
          + " pick and score as the fleet's kv_index.pick does.")


# --------------------------------------------------------------------------- 3. decode first
REMOTE_CASES = {   # (case, num_prompt_tokens, cached_blocks, block_size, pd_min_uncached_tokens)
    "visible": [
        ("a new prompt of 300 tokens, nothing cached", 300, 0, 16, 64),
        ("a chat's next turn: 280 of 300 tokens cached", 300, 17, 16, 64),
        ("pd_min_uncached_tokens 0: always remote", 40, 0, 16, 0),
    ],
    "hidden": [
        ("exactly pd_min_uncached_tokens left to compute: decode computes them", 100, 9, 4, 64),
        ("one token more than pd_min_uncached_tokens: remote", 101, 9, 4, 64),
        ("the whole prompt cached, pd_min_uncached_tokens 0: still remote", 64, 4, 16, 0),
        ("most of the prompt cached, but the rest is long: remote", 1000, 50, 16, 64),
        ("a short prompt with nothing cached: decode computes it", 50, 0, 16, 64),
    ],
}


def _remote_hint(kw: dict, got: Any) -> str:
    uncached = kw["num_prompt_tokens"] - kw["cached_blocks"] * kw["block_size"]
    if kw["pd_min_uncached_tokens"] <= 0:
        return "pd_min_uncached_tokens 0 means every request is prefilled remotely."
    if uncached == kw["pd_min_uncached_tokens"]:
        return ("remote only when MORE than pd_min_uncached_tokens are left to compute: at "
                "exactly that many, decode computes them.")
    return ("count the tokens the decode replica would still compute: num_prompt_tokens - "
            "cached_blocks * block_size (tokens, not blocks), against pd_min_uncached_tokens.")


@exercise(name="needs_remote_prefill", assignment="pd_at_scale",
          article_step="P/D at scale (after the article): the decode-first P/D decision, "
                       "pd_min_uncached_tokens (llm-d's prefix-based P/D decider)",
          forbidden=(f"{KV_INDEX}:needs_remote_prefill",),
          mistakes=("remote at exactly pd_min_uncached_tokens left (>= instead of >)",
                    "pd_min_uncached_tokens 0 not read as 'always remote' (a fully cached prompt "
                    "then stays local)",
                    "the cached part compared with the threshold, or blocks compared with "
                    "tokens"))
def check_needs_remote_prefill(fn: Callable, cases: str = "all") -> None:
    """``fn(num_prompt_tokens, cached_blocks, block_size, pd_min_uncached_tokens)`` -> bool,
    against the fleet's ``kv_index.needs_remote_prefill``."""
    from minivllm.disagg.fleet.kv_index import needs_remote_prefill
    name = "needs_remote_prefill"
    hand = [c for part in ("visible", "hidden") if cases in (part, "all")
            for c in REMOTE_CASES[part]]
    rng = random.Random(7)
    n_ref = 30 if cases != "visible" else 0
    for i in range(n_ref):
        bs = rng.choice([4, 16])
        n = rng.randint(1, 400)
        hand.append((f"random #{i}", n, rng.randint(0, n // bs), bs, rng.choice([0, 16, 64, 100])))
    for case, n, cached, bs, threshold in hand:
        kw = dict(num_prompt_tokens=n, cached_blocks=cached, block_size=bs,
                  pd_min_uncached_tokens=threshold)
        want = needs_remote_prefill(**kw)
        got = _call(name, fn, case, kw)
        if not isinstance(got, (bool, int)) or bool(got) != want:
            _fail(name, case, kw, want, got, _remote_hint(kw, got))
    print(f"\u2713 {name}: {len(hand) - n_ref} hand-made cases"
          + (f" and {n_ref} random ones" if n_ref else "")
          + " decide as the fleet's kv_index.needs_remote_prefill does.")
