"""vLLM 0.32's variants of the model runner, each a mixin in a file of its own that overrides the
article's functions in ``worker/model_runner.py`` and ``worker/kv_connector_model_runner_mixin.py``.
``worker.get_model_runner_cls`` picks them from the configuration, once, at construction:

| file | mixin | when |
|---|---|---|
| async_scheduling.py | ``AsyncSchedulingMixin`` | ``LLM(..., async_scheduling=True)`` |
| defer_finalize.py | ``DeferFinalizeMixin`` | P/D with EAGLE, EAGLE-3 or the draft model |
| kv_connector_context.py | ``VllmTodayKVConnectorMixin`` | ``kv_connector_context="vllm_today"`` |
| draft_probs.py | ``ProbabilisticDraftsMixin`` | ``draft_sample_method="probabilistic"`` |
| dynamic_k.py | ``DynamicSpecTokensMixin`` | ``num_speculative_tokens_per_batch_size`` set |

``python -m minivllm.tour spec|pd --then-and-now`` prints each override beside the article's
function it replaces.
"""
