"""Views of the engine's step records (``minivllm/trace.py``): what the engine did, step by step, drawn
and printed (the notebooks' pictures, the README's figures).

Every view reads recorded events only; none recomputes what the engine did.

- ``render_block_table_text`` / ``block_table_figure``: block tables, pool, free queue, prefix hits.
- ``token_budget_plot``, ``request_timeline_plot``, ``kv_usage_plot``: many steps at once.
- ``spec_step_figure`` / ``render_spec_step_text``: one verify step's drafts and decisions.
- ``viz/residual.py``: ``VerifyProbe`` (keeps the distributions the rejection sampler tested against,
  as step records), ``rejection_of`` / ``render_rejection_text`` / ``residual_figure`` (a rejected
  draft, its residual, the recovered token), ``race_counts`` / ``race_figure`` (the exponential
  race), ``render_logits_rows_text`` (step 6's rows), ``lookahead_figure`` (reserved slots).
- ``render_penalty_verify_text`` / ``penalty_verify_figure``: the penalty at each draft position,
  earlier drafts counted (the rejection sampler) vs ignored, and the decisions (``find_penalty_verify``).
- ``acceptance_per_position_plot``, ``acceptance_length_plot``: draft acceptance.
- ``connector_timeline``, ``pd_flow_figure``, ``pd_files_table``: disaggregated prefill/decode.
- ``StepSlider``: an ipywidgets slider over the recorded steps, showing any of the views above.

Text views fit a notebook screen (about 60 lines): long id lists print as length, head and tail
(``minivllm/learn/viz/text.py``).
"""
from minivllm.learn.viz.block_table import (block_table_figure, parse_block_table_text,
                                      render_block_table_text)
from minivllm.learn.viz.pd import connector_timeline, pd_files_table, pd_flow_figure
from minivllm.learn.viz.plots import (acceptance_length_plot, acceptance_per_position_plot,
                                acceptance_rates, kv_usage_plot, mean_acceptance_length,
                                request_timeline_plot, token_budget_plot)
from minivllm.learn.viz.records import (acceptance_counts, connector_calls, output_tokens_before,
                                   request_states, spec_verify_of)
from minivllm.learn.viz.spec_penalty import (find_penalty_verify, penalty_verify_figure,
                                       render_penalty_verify_text)
from minivllm.learn.viz.spec import (find_spec_step, find_spec_verify, render_spec_step_text,
                               spec_step_figure)
from minivllm.learn.viz.widgets import StepSlider

__all__ = [
    "StepSlider", "acceptance_counts", "acceptance_length_plot", "acceptance_per_position_plot",
    "acceptance_rates", "block_table_figure", "connector_calls", "connector_timeline",
    "find_penalty_verify", "find_spec_step", "find_spec_verify", "kv_usage_plot",
    "mean_acceptance_length", "output_tokens_before", "parse_block_table_text", "pd_files_table",
    "pd_flow_figure", "penalty_verify_figure", "render_block_table_text",
    "render_penalty_verify_text", "render_spec_step_text", "request_states",
    "request_timeline_plot", "spec_step_figure", "spec_verify_of", "token_budget_plot",
]
