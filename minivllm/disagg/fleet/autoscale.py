"""The fleet's autoscaling policy: how many prefill and decode replicas the live request mix needs.

The article: "we run N vLLM prefill instances and M vLLM decode instances, autoscaling them based
on the live request mix". A burst of long prompts queues prompt tokens in front of prefill and
leaves decode idle; long generations fill decode's batches and KV cache while prefill idles. So
one policy sizes both counts from each role's own load (NVIDIA Dynamo's planner does the same):

- prefill: ``ceil(queued prompt tokens / prefill_target_queued_tokens)`` replicas;
- decode: ``ceil(running requests / decode_target_running)``, one more while the mean KV usage is
  above ``decode_target_kv_usage``;
- each clamped to ``[min, max]``, and applied only once wanted without a break for
  ``upscale_delay_s`` (up) or ``downscale_delay_s`` (down), so a noisy series does not flap.

``decide`` is pure: a recorded series in, the counts out, no Ray. ``FleetAutoscalingPolicy``
is Ray Serve's application-level ``autoscaling_policy`` (ray/serve/autoscaling_policy.py), which
gets every deployment's ``AutoscalingContext`` at once, so both counts are decided in one place.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

# What each role's replicas report (replicas.engine_load) and ``GET /fleet`` shows of it.
ROLE_METRICS = {"prefill": ("waiting_prompt_tokens", "running_prefills", "kv_cache_usage",
                            "ttft_recent_s"),
                "decode": ("running_requests", "kv_cache_usage", "itl_recent_s")}
AVERAGED = ("kv_cache_usage", "ttft_recent_s", "itl_recent_s")      # the rest are summed


@dataclass
class FleetTargets:
    """The policy's configuration (the fleet command's flags). Defaults suit one CPU replica of a
    small model: about one long prompt's worth of tokens queued per prefill replica, four running
    generations per decode replica."""
    prefill_min: int = 1
    prefill_max: int = 3
    decode_min: int = 1
    decode_max: int = 3
    prefill_target_queued_tokens: int = 1024   # queued prompt tokens one prefill replica absorbs
    decode_target_running: int = 4             # running requests per decode replica
    decode_target_kv_usage: float = 0.8        # mean KV usage above this: one more decode replica
    upscale_delay_s: float = 1.0               # a wish to grow must last this long
    downscale_delay_s: float = 5.0             # a wish to shrink must last this long

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, f"{role}_min"), getattr(self, f"{role}_max")
            if not 0 <= lo <= hi or hi < 1:
                raise ValueError(f"{role}: need 0 <= min <= max and max >= 1, got {lo}:{hi}.")
        if self.prefill_target_queued_tokens < 1 or self.decode_target_running < 1:
            raise ValueError("the per-replica targets must be >= 1.")
        if not 0 < self.decode_target_kv_usage <= 1:
            raise ValueError("decode_target_kv_usage must be in (0, 1].")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("the delays must be >= 0 seconds.")


@dataclass
class Decision:
    num_prefill: int
    num_decode: int
    reason: str
    state: dict = field(default_factory=dict)   # pass back into the next ``decide``


def _wanted(role: str, metrics: dict, current: int, t: FleetTargets) -> tuple[int, str]:
    """The count one role's load asks for now (clamped), and why."""
    lo, hi = getattr(t, f"{role}_min"), getattr(t, f"{role}_max")
    if role == "prefill":
        queued = float(metrics.get("waiting_prompt_tokens", 0.0))
        n = math.ceil(queued / t.prefill_target_queued_tokens)
        why = f"{queued:.0f} queued prompt tokens / {t.prefill_target_queued_tokens} per replica"
    else:
        running = float(metrics.get("running_requests", 0.0))
        usage = float(metrics.get("kv_cache_usage", 0.0))
        n = math.ceil(running / t.decode_target_running)
        why = f"{running:.1f} running / {t.decode_target_running} per replica"
        if usage > t.decode_target_kv_usage:
            n = max(n, current + 1)
            why += f", KV usage {usage:.2f} > {t.decode_target_kv_usage}"
    return min(max(n, lo), hi), why


def decide(metrics: dict[str, dict[str, float]], current: dict[str, int], targets: FleetTargets,
           state: Optional[dict] = None, now: Optional[float] = None) -> Decision:
    """Both roles' counts from their load. ``metrics``: ``{role: role_metrics(...)}``;
    ``current``: ``{role: count}`` decided so far (Serve's targets); ``state``: the previous
    ``Decision.state`` (which way each role wishes to go, and since when)."""
    now = time.time() if now is None else now
    state = dict(state or {})
    out, reasons = {}, []
    for role in ("prefill", "decode"):
        cur = out[role] = int(current.get(role, 0))
        want, why = _wanted(role, metrics.get(role, {}), cur, targets)
        direction = "up" if want > cur else "down" if want < cur else None
        if direction is None or state.get(f"{role}_wish") != direction:
            state.pop(f"{role}_wish", None)           # no wish, or a new one: its clock starts
            state.pop(f"{role}_since", None)
        if direction is None:
            reasons.append(f"{role} stays {cur} ({why})")
            continue
        since = state.setdefault(f"{role}_since", now)
        state[f"{role}_wish"] = direction
        delay = targets.upscale_delay_s if direction == "up" else targets.downscale_delay_s
        if now - since >= delay:
            out[role] = want
            del state[f"{role}_wish"], state[f"{role}_since"]
            reasons.append(f"{role} {cur}->{want} ({why}, wanted for {now - since:.1f} s)")
        else:
            reasons.append(f"{role} stays {cur}, wants {want} ({why}, {now - since:.1f}/"
                           f"{delay:.1f} s)")
    return Decision(out["prefill"], out["decode"], "; ".join(reasons), state)


def role_metrics(role: str, aggregated: dict[str, dict[Any, float]]) -> dict[str, float]:
    """One role's load from Serve's ``aggregated_metrics`` (``{metric: {replica_id: value}}``)."""
    out = {}
    for name in ROLE_METRICS[role]:
        values = [float(v) for v in (aggregated.get(name) or {}).values()]
        total = sum(values, 0.0)
        out[name] = total / len(values) if values and name in AVERAGED else total
    return out


class FleetAutoscalingPolicy:
    """Serve's application-level policy (app.app_config names it). Serve builds it once in
    its controller and calls it every control-loop tick with ``{DeploymentID: AutoscalingContext}``;
    it returns ``({DeploymentID: replicas}, state)``. Each tick also goes to ``FleetState``."""

    def __init__(self, state_actor: str = "", namespace: str = "", **targets: Any) -> None:
        self.targets = FleetTargets(**targets)
        self.state: dict = {}
        self._actor_name, self._namespace, self._actor = state_actor, namespace, None

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        by_role = {d.name: (d, ctx) for d, ctx in contexts.items()
                   if d.name in ("prefill", "decode")}
        if len(by_role) < 2:      # the application is still being deployed
            return {}, {}
        metrics = {role: role_metrics(role, ctx.aggregated_metrics or {})
                   for role, (_, ctx) in by_role.items()}
        # Decide against the current *target*: a replica being started counts, or the next tick
        # would cancel it before it serves.
        target = {role: ctx.target_num_replicas for role, (_, ctx) in by_role.items()}
        running = {role: ctx.current_num_replicas for role, (_, ctx) in by_role.items()}
        d = decide(metrics, target, self.targets, self.state)
        self.state = d.state
        self._report({"time": time.time(), "prefill": d.num_prefill, "decode": d.num_decode,
                      "running": running, "metrics": metrics, "reason": d.reason,
                      "wishes": {r: d.state.get(f"{r}_wish") for r in ("prefill", "decode")}})
        return ({by_role["prefill"][0]: d.num_prefill, by_role["decode"][0]: d.num_decode}, {})

    def _report(self, record: dict) -> None:
        if not self._actor_name:
            return
        try:
            import ray
            if self._actor is None:
                self._actor = ray.get_actor(self._actor_name, namespace=self._namespace)
            self._actor.record_decision.remote(record)    # fire and forget: never block Serve
        except Exception:                                 # noqa: BLE001  the fleet is stopping
            self._actor = None

