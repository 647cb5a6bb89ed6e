"""The quick tier: ``pytest -q -m quick`` runs every component once, in about three minutes on two
cores, for the inner loop of someone editing one function. CI runs everything.

``QUICK`` names, per test module, the tests in the tier (``ALL``: the whole module; a name with
``[...]`` is one parametrisation). Chosen for
cover, not for speed alone: the scheduler, the KV cache and its prefix cache, the engine end to end
on a tiny model, the model against transformers, attention (reference, CPU backend), linear
routes, sampling and its vLLM options, the rejection sampler (torch and Triton), the n-gram
proposer and speculative decoding end to end, the P/D connector in both roles and its faults, the
breakpoints and the tour's registry, the README's structure and the import contracts, the stored
notebooks' rules. The default model, notebook runs, servers, the real vLLM and the browser stay in
the full run.
"""
from __future__ import annotations

ALL = None
QUICK: dict[str, "tuple[str, ...] | None"] = {
    # scheduler, KV cache, prefix cache
    "test_block_pool.py": ALL,
    "test_kv_cache_manager.py": ALL,
    "test_scheduler_vllm_unit_cases.py": ALL,
    "test_delayed_free.py": ALL,
    # the engine and the model, on tiny checkpoints
    "test_engine.py": ("test_greedy_matches_hf_on_tiny_checkpoints",
                       "test_preemption_gives_identical_output",
                       "test_chunked_prefill_gives_identical_output",
                       "test_prefix_cache_hit_on_repeated_prompt", "test_stop_conditions",
                       "test_step_records"),
    "test_model.py": ("test_prefill_logits_equal_hf", "test_tied_lm_head_shares_embeddings",
                      "test_chunked_prefill_then_decode_equal_hf",
                      "test_rotary_equals_textbook_form_and_reuses_rows_within_one_forward"),
    "test_layernorm.py": ALL,
    "test_bad_inputs.py": ALL,
    "test_gc_heap.py": ALL,
    # attention and linear
    "test_attention_backends.py": ("test_auto_is_cpu_attn_on_a_cpu",
                                   "test_backends_equal_on_mixed_steps[4-2-32-4-dtype0--1]",
                                   "test_backends_equal_on_mixed_steps[6-1-16-8-dtype2-0]"),
    "test_linear.py": ALL,
    "test_linear_method.py": ALL,
    "test_route_cache.py": ("test_a_second_process_reads_the_choices_and_times_nothing",
                            "test_the_tuning_budget_leaves_the_rest_on_f_linear_for_a_later_process"),
    # sampling
    "test_sampler.py": ALL,
    "test_sampling_params.py": ("test_defaults_are_vllms",
                                "test_out_of_range_is_a_value_error_naming_the_field"),
    "test_sampler_ops.py": ("test_penalties_equal_vllm_formula", "test_logits_processors_run_in_vllm_order",
                            "test_rejection_sampler_counts_earlier_drafts_as_outputs"),
    # speculative decoding
    "test_ngram_proposer.py": ALL,
    "test_spec_decode_metadata.py": ALL,
    "test_rejection_reference.py": ALL,
    "test_rejection_sampler.py": ALL,
    "test_spec_decode_e2e.py": ("test_lengths_are_exact", "test_mixed_batch_with_and_without_drafts",
                                "test_calc_spec_decode_metadata_worked_example"),
    "test_async_scheduling.py": ALL,
    # P/D
    "test_kv_connector_unit.py": ALL,
    "test_kv_transfer_imports.py": ALL,
    "test_pd_disaggregation.py": ("test_decode_prompt_extends_prefill_prompt_by_its_token",
                                  "test_connector_calls_per_role",
                                  "test_corrupt_bytes_are_caught_at_lookup"),
    "test_vllm_today_context.py": ("test_order_around_the_forward",),
    # the simulator: its steps are the real scheduler's
    "test_sim.py": ("test_scheduling_decisions_are_the_real_ones",
                    "test_fit_recovers_known_coefficients"),
    # the fleet in virtual time: the fleet's own router, the KV pull's cost
    "test_sim_fleet.py": ("test_multiturn_turns_go_to_the_decode_replica_holding_the_conversation",
                          "test_pd_ttft_includes_the_transfer"),
    # the reader's side: breakpoints, the readable core, README, import contracts
    "test_steps.py": ALL,
    # the walks run the default model (its drafts come from its own repetition): full run only
    "test_readable_core.py": ("test_tour_stop_is_short_and_plain", "test_code_lines_counts_the_body_only",
                              "test_then_and_now_rows_resolve_to_a_real_override",
                              "test_overlays_are_chosen_from_the_configuration",
                              "test_file_code_lines_skips_docstrings_comments_and_blanks"),
    "test_readme.py": ("test_readme_is_short_and_every_block_parses",
                       "test_readme_breakpoint_table_matches_the_registry",
                       "test_readme_layout_lists_current_files_and_line_counts"),
    "test_import_contract.py": ALL,
    "test_viz_text.py": ALL,
    # the lessons as stored (no notebook runs): the staleness rule, sizes, the exercises' count
    "test_notebooks.py": ("test_a_stale_stored_output_fails_naming_the_cell",
                          "test_what_a_fresh_machine_prints_once_is_not_compared",
                          "test_stored_notebooks_are_small_with_png_figures_and_static_widgets",
                          "test_every_cell_left_uncompared_is_listed_with_its_reason",
                          "test_one_count_of_exercises_everywhere"),
    "test_exercise_checks.py": ("test_the_suffix_walk_check_names_the_case_and_hints_at_the_common_"
                                "mistakes",),
}


def quick_name(module_file: str, function: str, test_id: str) -> "str | None":
    """The ``QUICK`` entry that puts this test in the tier (``function``: its name without
    parameters; ``test_id``: with them), ``""`` for a whole module, or ``None``."""
    if module_file not in QUICK:
        return None
    names = QUICK[module_file]
    if names is ALL:
        return ""
    return function if function in names else test_id if test_id in names else None
