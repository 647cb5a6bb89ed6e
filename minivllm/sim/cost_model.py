"""What one engine step costs, from its shape: the simulator's clock. No vLLM file: vLLM has no
simulator (Vidur's ``execution_time_predictor`` and LLMServingSim's profiles play this role for
theirs). No article step either: it times the step the article walks through (``EngineCore.step``:
``schedule()`` -> ``execute_model()`` -> ``update_from_output()``), from what ``schedule()`` chose.

- ``StepShape``: one step's shape, read from the real ``SchedulerOutput`` (``num_scheduled_tokens``,
  ``scheduled_spec_decode_tokens``, each request's ``num_computed_tokens``): the requests, the
  prefill and decode tokens, the drafts verified, the context each token attends, and how many
  requests the drafter proposes for afterwards.
- ``CostModel``: the roofline's shape with its coefficients fitted on this machine
  (``python -m minivllm.sim profile``)::

      t = step_s                               weights streamed once per step + launch overhead
        + prefill_token_s * num_prefill_tokens   the matmuls' work per query token (prefill)
        + decode_token_s  * num_decode_tokens    per decoding request: its token, its LM-head row,
                                                 its sampling and its bookkeeping
        + draft_token_s   * num_draft_tokens     a draft verified: one more query and logits row
        + prefill_attn_s  * prefill_context_sum  attention work, query-key pairs (compute-bound)
        + decode_attn_s   * decode_context_sum   KV read by decode requests (memory-bound)
        + drafter_step_s  * (1 if drafting)      the drafter's fixed cost per step (a draft
        + drafter_req_s   * num_drafting_reqs    model's k passes), and per request it drafts for

  Every coefficient is a time per unit, fitted by non-negative least squares on relative error
  (``fit``); a step that schedules nothing costs nothing. On a CPU with one torch thread the
  terms are fitted to the step's CPU time (the thread's: what the step itself costs), and
  ``contention`` (wall seconds per CPU second, the median over the profile's steps) turns them
  into wall time: on a machine other processes share, a step waits for a core as well (1 on an
  idle machine; about ``N / cores`` for N busy engines sharing the cores). ``bench roofline``'s
  speed-up prediction is the same model at batch 1 with two of its terms, taken from the
  difference of two separately timed medians; see ``fit`` for what changes here.
- ``Acceptance``: how many drafts a verify step accepts, measured on a real run (the
  distribution of the accepted length for a full proposal of ``k``, and how often the drafter
  proposes at all: n-gram proposes nothing when the context has no match).
- The stored file: JSON, the coefficients with the machine, model, torch version and date they were
  fitted on, at ``default_path(model)`` (``$MINIVLLM_CACHE_DIR/sim/<model>.json``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from minivllm.core.sched.output import SchedulerOutput
from minivllm.utils import cache_dir

FORMAT = "minivllm.sim.cost_model/1"


@dataclass(frozen=True)
class StepShape:
    """One engine step as the cost model sees it. A request's *query* this step is its scheduled
    tokens less its drafts (``q``); it is a **decode** request when ``q == 1`` and the step samples
    it, a **prefill** request otherwise (a prompt chunk, or a resumed request recomputing).
    ``c`` is what it had computed before the step (``num_computed_tokens``)."""
    num_reqs: int = 0
    num_prefill_reqs: int = 0
    num_decode_reqs: int = 0
    num_prefill_tokens: int = 0      # sum of q over prefill requests
    num_decode_tokens: int = 0       # one per decode request
    num_draft_tokens: int = 0        # drafts verified (scheduled_spec_decode_tokens)
    # Keys attended, summed: a prefill chunk's token i attends c + i + 1 keys, so a chunk of q adds
    # q * c + q * (q + 1) / 2; a decode request reads its whole KV once, c + 1 + drafts.
    prefill_context_sum: int = 0
    decode_context_sum: int = 0
    num_sampled_reqs: int = 0        # requests that sample this step (a prompt's last chunk too)
    num_drafting_reqs: int = 0       # requests the drafter proposes for after this step

    @classmethod
    def from_scheduler_output(cls, scheduler_output: SchedulerOutput, num_tokens: Mapping[str, int],
                              speculating: bool = False) -> "StepShape":
        """The shape of the step ``scheduler_output`` schedules. ``num_tokens``: each scheduled
        request's tokens before the step (prompt + outputs, drafts not counted), which the worker
        knows and the ``SchedulerOutput`` does not carry for running requests: a request samples
        when its computed tokens reach them. ``speculating``: a drafter proposes for every request
        that samples."""
        so = scheduler_output
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        spec = so.scheduled_spec_decode_tokens
        n_pre = n_dec = t_pre = t_draft = a_pre = a_dec = n_sampled = 0
        for req_id, n in so.num_scheduled_tokens.items():
            c = computed[req_id]
            d = len(spec.get(req_id, ()))
            q = n - d
            samples = c + q >= num_tokens[req_id]
            n_sampled += samples
            t_draft += d
            if q == 1 and samples:
                n_dec += 1
                a_dec += c + 1 + d
            else:
                n_pre += 1
                t_pre += q
                a_pre += q * c + q * (q + 1) // 2
        return cls(num_reqs=len(so.num_scheduled_tokens), num_prefill_reqs=n_pre,
                   num_decode_reqs=n_dec, num_prefill_tokens=t_pre, num_decode_tokens=n_dec,
                   num_draft_tokens=t_draft, prefill_context_sum=a_pre, decode_context_sum=a_dec,
                   num_sampled_reqs=n_sampled,
                   num_drafting_reqs=n_sampled if speculating else 0)

    def features(self) -> tuple[float, ...]:
        """The row this step adds to the fit, one number per coefficient (``COEFFICIENTS``)."""
        if self.num_reqs == 0:
            return (0.0,) * len(COEFFICIENTS)
        return (1.0, self.num_prefill_tokens, self.num_decode_tokens, self.num_draft_tokens,
                self.prefill_context_sum, self.decode_context_sum,
                1.0 if self.num_drafting_reqs else 0.0, self.num_drafting_reqs)

    @property
    def shape_class(self) -> str:
        """``prefill``, ``decode`` or ``mixed``, ``+spec`` when drafts are verified or proposed:
        the groups the fit's error is reported by."""
        kind = ("mixed" if self.num_prefill_reqs and self.num_decode_reqs else
                "prefill" if self.num_prefill_reqs else "decode" if self.num_decode_reqs else
                "empty")
        return kind + ("+spec" if self.num_draft_tokens or self.num_drafting_reqs else "")


COEFFICIENTS = ("step_s", "prefill_token_s", "decode_token_s", "draft_token_s", "prefill_attn_s",
                "decode_attn_s", "drafter_step_s", "drafter_req_s")


@dataclass
class Acceptance:
    """Measured drafting: ``accepted_length_probs[a]`` is the probability that a proposal of
    ``num_speculative_tokens`` drafts has its first ``a`` accepted (a = 0..k); a shorter
    proposal (the request's remaining length caps it) accepts at most what it has.
    ``draft_probability``: how often a request that samples gets drafts at all;
    ``num_observed``: the verifies it was measured on."""
    method: str
    num_speculative_tokens: int
    accepted_length_probs: list[float]
    draft_probability: float = 1.0
    num_observed: int = 0

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if len(self.accepted_length_probs) != k + 1:
            raise ValueError(f"accepted_length_probs needs k + 1 = {k + 1} entries (accepted "
                             f"0..{k}), got {len(self.accepted_length_probs)}.")
        total = sum(self.accepted_length_probs)
        if total <= 0 or min(self.accepted_length_probs) < 0:
            raise ValueError("accepted_length_probs must be non-negative and not all zero.")
        self.accepted_length_probs = [p / total for p in self.accepted_length_probs]
        if not 0.0 <= self.draft_probability <= 1.0:
            raise ValueError(f"draft_probability must be in [0, 1], got {self.draft_probability}.")

    @classmethod
    def measure(cls, method: str, k: int, verified: Sequence[tuple[int, int]],
                num_sampling: int, num_proposing: int) -> "Acceptance":
        """From a real run: ``verified`` = (drafts scheduled, drafts accepted) per verify;
        ``num_proposing`` of the ``num_sampling`` sampled request-steps got drafts.

        Every verify counts, the short ones too (a proposal cut by the request's remaining
        length): draft ``i`` was tried when the ``i - 1`` before it were accepted, so the rate of
        position ``i`` is accepted-at-``i`` over tried-at-``i`` (vLLM's per-position acceptance
        rate), and the distribution for a full proposal is
        ``P(a) = r_1 ... r_a (1 - r_{a+1})``. A position never tried has rate 0."""
        tried, accepted = [0] * (k + 1), [0] * (k + 1)
        for n, a in verified:
            for i in range(1, min(a + 1, n) + 1):
                tried[i] += 1
                accepted[i] += i <= a
        probs, reach = [], 1.0
        for i in range(1, k + 1):
            rate = accepted[i] / tried[i] if tried[i] else 0.0
            probs.append(reach * (1.0 - rate))
            reach *= rate
        probs.append(reach)
        return cls(method, k, probs,
                   draft_probability=num_proposing / num_sampling if num_sampling else 1.0,
                   num_observed=len(verified))

    @property
    def mean_accepted(self) -> float:
        return sum(a * p for a, p in enumerate(self.accepted_length_probs))


@dataclass
class CostModel:
    """Seconds per unit for each term of the step time (module docstring). ``meta``: where and
    when it was fitted (``machine``, ``model``, ``torch``, ``date``, ...) and the fit's error per
    shape class; ``acceptance``: the drafting measured with it, if any."""
    step_s: float = 0.0
    prefill_token_s: float = 0.0
    decode_token_s: float = 0.0
    draft_token_s: float = 0.0
    prefill_attn_s: float = 0.0
    decode_attn_s: float = 0.0
    drafter_step_s: float = 0.0
    drafter_req_s: float = 0.0
    contention: float = 1.0
    meta: dict[str, Any] = field(default_factory=dict)
    acceptance: Optional[Acceptance] = None

    def predict(self, shape: StepShape) -> float:
        """Wall seconds for a step of this shape (0 for a step that schedules nothing)."""
        if shape.num_reqs == 0:
            return 0.0
        return self.contention * self.predict_terms(shape)

    def predict_terms(self, shape: StepShape) -> float:
        """The formula's sum, before ``contention``."""
        if shape.num_reqs == 0:
            return 0.0
        t = (self.step_s + self.prefill_token_s * shape.num_prefill_tokens
             + self.decode_token_s * shape.num_decode_tokens
             + self.draft_token_s * shape.num_draft_tokens
             + self.prefill_attn_s * shape.prefill_context_sum
             + self.decode_attn_s * shape.decode_context_sum)
        if shape.num_drafting_reqs:
            t += self.drafter_step_s + self.drafter_req_s * shape.num_drafting_reqs
        return t

    @property
    def coefficients(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in COEFFICIENTS}

    @classmethod
    def fit(cls, samples: Sequence[tuple[StepShape, float]],
            wall_seconds: Optional[Sequence[float]] = None,
            acceptance: Optional[Acceptance] = None, **meta: Any) -> "CostModel":
        """Least squares on the *relative* error, every coefficient >= 0.

        Each step gives one row ``features(shape) . c = seconds``, divided by its seconds: a step
        of 40 ms weighs as much as one of 4 s, so the decode steps that make up most of a run are
        fitted as closely as the long prefills (timing noise here is proportional to the time,
        too). Columns are scaled to a largest entry of 1 before solving (their units run from 1 to
        ~10^6 pairs). ``scipy.optimize.nnls`` solves it exactly; without SciPy, ``numpy``'s
        least squares runs again without every column whose coefficient came out negative, until
        none does (an active-set step of Lawson and Hanson's NNLS, not always its optimum).
        A term no sample exercises (no drafting in the samples) stays 0 and is listed in
        ``meta["unfitted"]``. ``wall_seconds``: when the samples' seconds are CPU time, the same
        steps' wall time; ``contention`` is then the median of wall over CPU time, and
        ``meta["wall_error"]`` the error of the predictions against wall time.

        Against ``bench roofline``: its verify cost is ``curve[k] - curve[0]`` over a plain step,
        two medians of 3-5 timings each on a loaded machine, so noise in either enters the
        prediction whole; here every term comes from all the steps at once."""
        import numpy as np
        rows = [(s.features(), t) for s, t in samples if s.num_reqs and t > 0]
        if len(rows) < len(COEFFICIENTS):
            raise ValueError(f"fit needs at least {len(COEFFICIENTS)} timed steps, "
                             f"got {len(rows)}.")
        x = np.array([f for f, _ in rows], dtype=float)
        y = np.array([t for _, t in rows], dtype=float)
        x, ones = x / y[:, None], np.ones_like(y)
        scale = x.max(axis=0)
        used = scale > 0
        coef = np.zeros(x.shape[1])
        coef[used] = _nnls(x[:, used] / scale[used], ones) / scale[used]
        terms = cls(**dict(zip(COEFFICIENTS, (float(c) for c in coef))))
        meta = dict(meta, unfitted=[n for n, u in zip(COEFFICIENTS, used) if not u],
                    num_samples=len(rows), fit_error=terms.fit_report(samples))
        contention = 1.0
        if wall_seconds is not None:
            ratios = [w / t for (_, t), w in zip(samples, wall_seconds) if t > 0]
            contention = float(np.median(ratios)) if ratios else 1.0
            with_contention = dataclasses.replace(terms, contention=contention)
            meta["wall_error"] = with_contention.fit_report(
                [(s, w) for (s, _), w in zip(samples, wall_seconds)])
        return dataclasses.replace(terms, contention=contention, meta=meta, acceptance=acceptance)

    def fit_report(self, samples: Sequence[tuple[StepShape, float]]) -> dict[str, dict]:
        """Per shape class: steps, mean measured and predicted seconds, mean and p90 of
        ``|predicted - measured| / measured``, and the mean signed error (the bias)."""
        import numpy as np
        groups: dict[str, list[tuple[float, float]]] = {}
        for shape, t in samples:
            if shape.num_reqs and t > 0:
                groups.setdefault(shape.shape_class, []).append((self.predict(shape), t))
        out = {}
        for name, pairs in sorted(groups.items()):
            p, t = np.array(pairs).T
            rel = (p - t) / t
            out[name] = {"steps": len(pairs), "measured_mean_s": float(t.mean()),
                         "predicted_mean_s": float(p.mean()),
                         "abs_rel_err_mean": float(np.abs(rel).mean()),
                         "abs_rel_err_p90": float(np.percentile(np.abs(rel), 90)),
                         "rel_err_mean": float(rel.mean())}
        return out

    # ------------------------------------------------------------------ the stored file
    def to_json(self) -> dict:
        return {"format": FORMAT, "coefficients": self.coefficients,
                "contention": self.contention, "meta": self.meta,
                "acceptance": None if self.acceptance is None
                else dataclasses.asdict(self.acceptance)}

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        if data.get("format") != FORMAT:
            raise ValueError(f"not a cost model file of format {FORMAT!r} "
                             f"(format {data.get('format')!r}).")
        coefficients = data["coefficients"]
        unknown = set(coefficients) - set(COEFFICIENTS)
        if unknown:
            raise ValueError(f"cost model: unknown coefficients {sorted(unknown)}.")
        acceptance = data.get("acceptance")
        return cls(**{k: float(v) for k, v in coefficients.items()},
                   contention=float(data.get("contention", 1.0)), meta=data.get("meta", {}),
                   acceptance=None if acceptance is None else Acceptance(**acceptance))

    def save(self, path: str) -> str:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(self.to_json(), fh, indent=1)
        os.replace(tmp, path)   # a reader never sees half a file
        return path

    @classmethod
    def load(cls, path: str, model: Optional[str] = None) -> "CostModel":
        """The model stored at ``path``; ``CostModelMissing`` (with the command that makes one)
        when there is none."""
        if not os.path.exists(path):
            raise CostModelMissing(path, model)
        with open(path) as fh:
            return cls.from_json(json.load(fh))


class CostModelMissing(FileNotFoundError):
    """No cost model stored for this model on this machine."""

    def __init__(self, path: str, model: Optional[str] = None) -> None:
        flag = f" --model {model}" if model else ""
        super().__init__(
            f"No cost model at {path}: the simulator needs this machine's step times for "
            f"{model or 'this model'}. Measure them once with `python -m minivllm.sim profile"
            f"{flag}` (a few minutes), or pass --cost-model FILE.")
        self.path = path


def default_path(model: str) -> str:
    """Where ``profile`` stores ``model``'s cost model on this machine:
    ``$MINIVLLM_CACHE_DIR/sim/<model>.json`` (``/`` in a hub id becomes ``--``; a local path
    gives its last component)."""
    name = model.rstrip("/")
    if os.path.isdir(os.path.expanduser(name)) or name.endswith(".gguf"):
        name = os.path.basename(name)
    name = re.sub(r"[^A-Za-z0-9._-]+", "--", name)
    return os.path.join(cache_dir(), "sim", f"{name}.json")


def _nnls(a: Any, b: Any) -> Any:
    import numpy as np
    try:
        from scipy.optimize import nnls
    except ImportError:
        nnls = None
    if nnls is not None:
        return nnls(a, b)[0]
    free = np.ones(a.shape[1], dtype=bool)
    x = np.zeros(a.shape[1])
    while free.any():
        sol = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        if (sol >= 0).all():
            x[free] = sol
            break
        idx = np.flatnonzero(free)
        free[idx[sol < 0]] = False
    return x
