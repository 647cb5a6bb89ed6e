"""The simulated worker: the methods ``EngineCore`` calls on vllm/v1/worker/gpu_worker.py's
``Worker`` (minivllm/worker/worker.py), with no model, no KV tensors and no sampling. Chosen at
construction through ``ParallelConfig.worker_cls`` (``WORKER_CLS`` in engine/core.py), as vLLM's
executor chooses its worker class; the engine's ``Scheduler``, ``KVCacheManager``, prefix cache and
speculative-decoding bookkeeping run unchanged around it. No article step of its own: it answers
the article's ``execute_model`` step without running the model.

Each step it
- follows the scheduler's requests as the real model runner does (``_update_states``: new requests,
  resumed ones, finished ones), keeping only what it needs: prompt length, ``max_tokens``, output
  count (the scheduler's ``num_output_tokens``, as the runner trims to it);
- answers every request whose computed tokens reach its known tokens (not a partial prefill chunk)
  with 1 + accepted drafts tokens: ``trace.reply_token`` of its prompt, so a request with
  ``SamplingParams(max_tokens=output_tokens, ignore_eos=True)`` runs exactly ``output_tokens`` and
  the scheduler's own ``check_stop`` ends it; or, after ``answer_with``, a real run's reply to
  that prompt (a validation against a real multi-turn run: the next turn's prompt holds the real
  reply, so the prefix cache finds what the real decode replica's held);
- proposes drafts when speculation is configured, as many as ``propose_draft_token_ids`` would
  allow (``k``, one short of ``max_tokens`` and of the model length), their count and acceptance
  drawn from a ``DraftSource``: ``MeasuredDrafts`` (an ``Acceptance`` measured on a real run) or
  ``ReplayedDrafts`` (a real run's per-step proposals and accepted lengths, for the equivalence
  test);
- advances its virtual ``clock`` by ``cost_model.predict(StepShape.from_scheduler_output(...))``.

``SimEngine`` (engine.py) gives it its cost model and draft source (``simulate_with``) before the
first step. No KV connector: a simulated P/D transfer is the fleet simulation's.
"""
from __future__ import annotations

import random
from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Optional, Protocol

from minivllm.config import VllmConfig
from minivllm.core.sched.output import SchedulerOutput
from minivllm.sim.cost_model import Acceptance, CostModel, StepShape
from minivllm.sim.trace import prompt_key, reply_token
from minivllm.utils import cdiv
from minivllm.worker.outputs import ModelRunnerOutput

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30    # worker/worker.py's default budget on a CPU


class DraftSource(Protocol):
    """How many drafts a request gets after a step, and how many of them the next step accepts."""

    def num_drafts(self, step: int, req_id: str, limit: int) -> int: ...

    def num_accepted(self, step: int, req_id: str, num_drafts: int) -> int: ...


class MeasuredDrafts:
    """Drafts as a real run measured them (``Acceptance``): a request that samples gets ``limit``
    drafts with probability ``draft_probability``; a verify accepts ``a`` with probability
    ``accepted_length_probs[a]``, at most what was proposed. Seeded: a run repeats exactly."""

    def __init__(self, acceptance: Acceptance, seed: int = 0) -> None:
        self.acceptance = acceptance
        self._cum = list(accumulate(acceptance.accepted_length_probs))
        self._rng = random.Random(seed)

    def num_drafts(self, step: int, req_id: str, limit: int) -> int:
        p = self.acceptance.draft_probability
        return limit if p >= 1.0 or self._rng.random() < p else 0

    def num_accepted(self, step: int, req_id: str, num_drafts: int) -> int:
        a = bisect_right(self._cum, self._rng.random() * self._cum[-1])
        return min(a, num_drafts)


@dataclass
class StepDrafts:
    """One real step's drafting: drafts proposed per request after it (``take_draft_token_ids``)
    and drafts accepted per request in it (verified requests only)."""
    proposed: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)


class ReplayedDrafts:
    """A real run's drafting replayed step by step (``steps[i]``: the i-th ``execute_model``). A
    replay that asks what the real run never did (more drafts than the request may take, a verify
    it did not record) raises: the two runs have parted."""

    def __init__(self, steps: list[StepDrafts]) -> None:
        self.steps = steps

    def num_drafts(self, step: int, req_id: str, limit: int) -> int:
        n = self.steps[step].proposed.get(req_id, 0) if step < len(self.steps) else 0
        if n > limit:
            raise RuntimeError(f"replay: step {step} proposed {n} drafts for {req_id}, which may "
                               f"take {limit} here: the runs differ.")
        return n

    def num_accepted(self, step: int, req_id: str, num_drafts: int) -> int:
        accepted = self.steps[step].accepted if step < len(self.steps) else {}
        if req_id not in accepted or accepted[req_id] > num_drafts:
            raise RuntimeError(f"replay: step {step} verified no {num_drafts} drafts of {req_id}"
                               " in the real run: the runs differ.")
        return accepted[req_id]


@dataclass
class _SimRequest:
    """What the simulated worker keeps of a request (the runner's ``CachedRequestState``, less
    the tokens and blocks)."""
    num_prompt_tokens: int
    max_tokens: int
    key: int                   # trace.prompt_key of its prompt: its reply's seed
    num_output_tokens: int = 0


class SimulatedWorker:
    """``Worker``'s interface on a virtual clock (module docstring)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.model_runner: Any = None      # no model
        self.kv_connector: Any = None      # no KV transfer here
        self.clock = 0.0                   # virtual seconds
        self.cost_model: Optional[CostModel] = None
        self.drafts: Optional[DraftSource] = None
        self.step_index = 0                # execute_model calls so far
        self.last_shape: Optional[StepShape] = None     # the last step's, for SimEngine
        self.last_scheduler_output: Optional[SchedulerOutput] = None
        self.requests: dict[str, _SimRequest] = {}
        spec = vllm_config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec else 0
        self.max_model_len = vllm_config.model_config.max_model_len
        self.vocab_size = int(vllm_config.hf_config.vocab_size)
        self._output: Optional[ModelRunnerOutput] = None
        self._draft_token_ids: Optional[dict[str, list[int]]] = None
        self.replies: dict[int, list[int]] = {}    # prompt_key -> a real run's reply to it

    def simulate_with(self, cost_model: CostModel, drafts: Optional[DraftSource] = None) -> None:
        """The step times and, with speculation, the drafting (default: the cost model's own
        ``Acceptance``, the one measured with it)."""
        if self.num_spec_tokens and drafts is None:
            if cost_model.acceptance is None:
                raise ValueError("speculative decoding is configured but neither a draft source "
                                 "nor a measured acceptance (cost_model.acceptance) was given.")
            drafts = MeasuredDrafts(cost_model.acceptance)
        self.cost_model, self.drafts = cost_model, drafts

    def answer_with(self, replies: dict[int, list[int]]) -> None:
        """Answer each prompt whose ``trace.prompt_key`` is in ``replies`` with those tokens (a
        real run's reply; positions past its end, and other prompts, get ``reply_token``)."""
        self.replies = dict(replies)

    def reply_token(self, key: int, position: int) -> int:
        """Output token ``position`` of the reply to the prompt whose key is ``key``."""
        reply = self.replies.get(key)
        if reply is not None and position < len(reply):
            return reply[position]
        return reply_token(key, position, self.vocab_size)

    def advance_clock_to(self, t: float) -> None:
        """Idle until ``t`` (a clock never runs back)."""
        self.clock = max(self.clock, t)

    # ------------------------------------------------------------------ Worker's interface
    def init_device(self) -> None:
        if self.vllm_config.scheduler_config.async_scheduling:
            raise ValueError("the simulated worker runs the article's step (async_scheduling="
                             "False): asynchronous scheduling's placeholders are not simulated.")

    def load_model(self) -> None:
        return None   # nothing to load: the step times come from the cost model

    def determine_num_available_blocks(self) -> int:
        """``num_gpu_blocks_override``, else ``Worker``'s rule without profiling: the budget
        (``kv_cache_memory_bytes``, else the CPU default) over the bytes of one block (K and V
        of every layer, the drafter's included, from the checkpoint's config), capped at what every
        sequence at full length could use."""
        cache = self.vllm_config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            if self.vllm_config.device != "cpu":
                raise ValueError("the simulated worker cannot measure a GPU's free memory: give "
                                 "num_gpu_blocks_override or kv_cache_memory_bytes.")
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        per_block = self.kv_cache_bytes_per_token() * cache.block_size
        sched = self.vllm_config.scheduler_config
        needed = sched.max_num_seqs * cdiv(self.max_model_len, cache.block_size) + 1
        return max(2, min(budget // per_block, needed))

    def kv_cache_bytes_per_token(self) -> int:
        """K and V of one token in every attention layer, the drafter's included, as
        ``ModelRunner.kv_cache_bytes_per_block`` counts them (over its block size)."""
        from minivllm.utils import resolve_auto_dtype
        c = self.vllm_config
        elem = _DTYPE_BYTES[resolve_auto_dtype(c.model_config.dtype, c.device)]

        def per_layer(hf: Any) -> int:
            head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
            kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
            return 2 * kv_heads * head_dim * elem

        hf, spec = c.hf_config, c.speculative_config
        layers = hf.num_hidden_layers
        draft = 0
        if spec is not None and spec.method == "draft_model":
            if spec.draft_num_layers is not None:
                layers += spec.draft_num_layers
            else:
                from minivllm.model_executor.model_loader import load_hf_config, resolve_model_path
                draft_hf = load_hf_config(resolve_model_path(spec.model))
                draft = draft_hf.num_hidden_layers * per_layer(draft_hf)
        elif spec is not None and spec.use_eagle():
            layers += 1    # the EAGLE head's one decoder layer, the target's shape
        return layers * per_layer(hf) + draft

    def initialize_cache(self, num_gpu_blocks: int) -> None:
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks   # no tensors

    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """The step, simulated: -> ``None`` (``sample_tokens`` returns the tokens), or the empty
        output of a step that scheduled nothing, as the real runner returns it."""
        if self.cost_model is None:
            raise RuntimeError("SimulatedWorker.simulate_with(cost_model) must be called before "
                               "the first step (SimEngine does).")
        step, self.step_index = self.step_index, self.step_index + 1
        self.last_scheduler_output = scheduler_output
        num_tokens = self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            self.last_shape = StepShape()
            return ModelRunnerOutput([], {}, [])
        shape = StepShape.from_scheduler_output(scheduler_output, num_tokens,
                                                speculating=self.num_spec_tokens > 0)
        self.last_shape = shape
        self.clock += self.cost_model.predict(shape)
        self._output = self._sample(step, scheduler_output, num_tokens)
        return None

    def sample_tokens(self) -> ModelRunnerOutput:
        output, self._output = self._output, None
        if output is None:
            raise RuntimeError("sample_tokens without a step to finish (execute_model first).")
        return output

    def take_draft_token_ids(self) -> Optional[dict[str, list[int]]]:
        drafts, self._draft_token_ids = self._draft_token_ids, None
        return drafts

    # ------------------------------------------------------------------ the step
    def _update_states(self, so: SchedulerOutput) -> dict[str, int]:
        """Follow the scheduler as ``ModelRunner._update_states`` does. -> each scheduled
        request's tokens before this step (prompt + outputs)."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        num_tokens: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            max_tokens = new.sampling_params.max_tokens
            self.requests[new.req_id] = _SimRequest(
                len(new.prompt_token_ids),
                self.max_model_len if max_tokens is None else max_tokens,
                prompt_key(new.prompt_token_ids))
            num_tokens[new.req_id] = len(new.prompt_token_ids)
        cached = so.scheduled_cached_reqs
        for req_id, num_output in zip(cached.req_ids, cached.num_output_tokens):
            state = self.requests[req_id]
            state.num_output_tokens = num_output   # the scheduler's count (tokens past a stop
            num_tokens[req_id] = state.num_prompt_tokens + num_output   # were dropped there)
        return num_tokens

    def _sample(self, step: int, so: SchedulerOutput,
                num_tokens: dict[str, int]) -> ModelRunnerOutput:
        """Tokens for every request whose computed tokens reach its known ones; then drafts."""
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        spec = so.scheduled_spec_decode_tokens
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        drafts: dict[str, list[int]] = {}
        for req_id in req_ids:
            n = so.num_scheduled_tokens[req_id]
            d = len(spec.get(req_id, ()))
            if computed[req_id] + n - d < num_tokens[req_id]:
                sampled.append([])          # a partial prefill chunk samples nothing
                continue
            count = 1 + (self.drafts.num_accepted(step, req_id, d) if d else 0)
            state = self.requests[req_id]
            start = state.num_output_tokens
            sampled.append([self.reply_token(state.key, start + i) for i in range(count)])
            state.num_output_tokens = start + count
            if self.num_spec_tokens:
                limit = max(0, min(self.num_spec_tokens,
                                   state.max_tokens - state.num_output_tokens - 1,
                                   self.max_model_len - 1 - num_tokens[req_id] - count))
                k = self.drafts.num_drafts(step, req_id, limit)
                # The drafts the reply would go on with: accepted ones are the tokens it emits.
                drafts[req_id] = [self.reply_token(state.key, state.num_output_tokens + i)
                                  for i in range(k)]
        if self.num_spec_tokens:
            self._draft_token_ids = drafts
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
