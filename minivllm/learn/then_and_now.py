"""Then and now: the article's function beside vLLM 0.32's override, as a diff of their source.
``python -m minivllm.tour spec|pd --then-and-now`` prints these at the stops they belong to;
``python -m minivllm.then_and_now [spec|pd]`` prints them all.

Each row: (tour stop, the article's function, vLLM 0.32's override, when the override applies).
Names are ``module.qualname`` strings.
"""
from __future__ import annotations

import difflib
import inspect
import sys
import textwrap

from minivllm.utils import resolve_obj_by_qualname

W = "minivllm.worker."
THEN_AND_NOW: tuple[tuple[str, str, str, str], ...] = (
    ("spec.2", W + "model_runner.ModelRunner.propose_draft_token_ids",
     W + "vllm_today.async_scheduling.AsyncSchedulingMixin.propose_draft_token_ids",
     "async_scheduling=True: the drafts stay in the worker"),
    ("spec.2", W + "model_runner.ModelRunner.propose_draft_token_ids",
     W + "vllm_today.draft_probs.ProbabilisticDraftsMixin.propose_draft_token_ids",
     'draft_sample_method="probabilistic": the drafter\'s q is kept'),
    ("spec.2", W + "model_runner.ModelRunner.num_spec_tokens_to_schedule",
     W + "vllm_today.dynamic_k.DynamicSpecTokensMixin.num_spec_tokens_to_schedule",
     "num_speculative_tokens_per_batch_size: k from the batch size (dynamic k)"),
    ("spec.3", "minivllm.core.sched.scheduler.Scheduler.update_draft_token_ids",
     "minivllm.core.sched.async_scheduler.AsyncScheduler.update_draft_token_ids",
     "async_scheduling=True: the scheduler stores placeholders"),
    ("spec.5", W + "model_runner.ModelRunner._update_states",
     W + "vllm_today.async_scheduling.AsyncSchedulingMixin._update_states",
     "async_scheduling=True: the runner's drafts replace the placeholders"),
    ("spec.7", W + "model_runner.ModelRunner._scheduled_draft_probs",
     W + "vllm_today.draft_probs.ProbabilisticDraftsMixin._scheduled_draft_probs",
     'draft_sample_method="probabilistic": draft_probs instead of one-hot drafts'),
    ("spec.7", W + "model_runner.ModelRunner._rejection_sample",
     W + "vllm_today.async_scheduling.AsyncSchedulingMixin._rejection_sample",
     "async_scheduling=True: only the real drafts are verified"),
    ("pd.enter", W + "kv_connector_model_runner_mixin.KVConnectorModelRunnerMixin._get_kv_connector_output",
     W + "vllm_today.kv_connector_context.get_kv_connector_output",
     'kv_connector_context="vllm_today" (and defer_finalize under spec decode)'),
    ("pd.exit", W + "kv_connector_model_runner_mixin.KVConnectorModelRunnerMixin.kv_connector_no_forward",
     W + "vllm_today.kv_connector_context.VllmTodayKVConnectorMixin.kv_connector_no_forward",
     'kv_connector_context="vllm_today": wait_for_save on empty steps too'),
    ("pd.exit", W + "model_runner.ModelRunner.sample_tokens",
     W + "vllm_today.defer_finalize.DeferFinalizeMixin.sample_tokens",
     "P/D with EAGLE or a draft model: the connector finalizes after the drafter"),
)


def diff(article: str, today: str) -> list[str]:
    """Unified diff of the two functions' source, the article's first."""
    def source(name: str) -> list[str]:
        return textwrap.dedent(inspect.getsource(inspect.unwrap(resolve_obj_by_qualname(name)))).splitlines()
    short = lambda n: n.replace("minivllm.", "")  # noqa: E731
    return list(difflib.unified_diff(source(article), source(today), short(article), short(today),
                                     n=2, lineterm=""))


def rows_for(step_id: str) -> list[tuple[str, str, str, str]]:
    return [row for row in THEN_AND_NOW if row[0] == step_id]


def describe(step_id: str) -> list[str]:
    lines = []
    for _, article, today, when in rows_for(step_id):
        lines.append(f"  then and now ({when}):")
        lines += ["    " + line for line in diff(article, today)]
    return lines


def main(argv: "list[str] | None" = None) -> int:
    part = (argv if argv is not None else sys.argv[1:]) or [""]
    for step_id in dict.fromkeys(r[0] for r in THEN_AND_NOW):
        if step_id.startswith(part[0]):
            print(step_id)
            print("\n".join(describe(step_id)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
