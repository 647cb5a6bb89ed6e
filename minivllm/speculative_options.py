"""``SpeculativeConfig``'s checks for the methods that came after the article's n-gram: the draft
model, the drafters' sampling, and suffix decoding (vLLM 0.32: ``config/speculative.py``, with
``_validate_suffix_decoding``); and n-gram's minivllm-only ``ngram_match`` rule. ``SpeculativeConfig``
runs them on every construction; they read its fields and never import ``config.py``.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
NGRAM_MATCH_RULES = ("first", "last")


class SpeculativeFields(Protocol):
    """The ``SpeculativeConfig`` fields these checks read (and the schedule they normalize)."""
    method: str
    model: Optional[str]
    ngram_match: str
    draft_num_layers: Optional[int]
    draft_sample_method: str
    rejection_sample_method: str
    synthetic_acceptance_rates: Optional[list[float]]
    synthetic_acceptance_length: Optional[float]
    num_speculative_tokens_per_batch_size: Optional[list]
    suffix_decoding_max_tree_depth: int
    suffix_decoding_max_cached_requests: int
    suffix_decoding_max_spec_factor: float
    suffix_decoding_min_token_prob: float


def check_drafter_options(spec: SpeculativeFields) -> None:
    """``spec``: a ``SpeculativeConfig``. Raises ``ValueError`` naming the field and what it allows."""
    if spec.method == "ngram" and spec.ngram_match not in NGRAM_MATCH_RULES:
        raise ValueError(f"speculative_config.ngram_match must be one of "
                         f"{NGRAM_MATCH_RULES}, got {spec.ngram_match!r}.")
    if spec.method == "draft_model":
        if (spec.model is None) == (spec.draft_num_layers is None):
            raise ValueError("speculative_config for method 'draft_model' needs exactly one of "
                             "'model' (a draft checkpoint) or 'draft_num_layers' (a self-draft).")
    if spec.draft_sample_method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"speculative_config.draft_sample_method must be one of "
                         f"{DRAFT_SAMPLE_METHODS}, got {spec.draft_sample_method!r}.")
    if (spec.draft_sample_method == "probabilistic"
            and spec.method not in ("eagle", "eagle3", "draft_model")):
        raise ValueError("speculative_config.draft_sample_method='probabilistic' needs method "
                         f"'eagle', 'eagle3' or 'draft_model', not {spec.method!r} (its drafts "
                         "have no distribution).")
    if spec.method == "suffix":   # vLLM checks these for this method only
        check_suffix_options(spec)
    check_verification_options(spec)
    if spec.method != "draft_model" and spec.draft_num_layers is not None:
        raise ValueError("speculative_config.draft_num_layers is for method 'draft_model' "
                         f"only, not {spec.method!r}.")


REJECTION_SAMPLE_METHODS = ("standard", "block")


def check_verification_options(spec: SpeculativeFields) -> None:
    """vLLM 0.32's checks on ``rejection_sample_method`` and on the dynamic-k schedule. minivllm has
    no watermarking, so vLLM's "watermarking only with 'standard'" has nothing to check here."""
    if spec.rejection_sample_method == "synthetic":
        raise ValueError("speculative_config.rejection_sample_method='synthetic' (vLLM's synthetic "
                         "acceptance rates, a benchmarking mode that accepts drafts at a set rate "
                         "whatever the models say) is not built in minivllm; use 'standard' (the "
                         "article's token-wise rule) or 'block' (block verification).")
    if spec.rejection_sample_method not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"speculative_config.rejection_sample_method must be one of "
                         f"{REJECTION_SAMPLE_METHODS}, got {spec.rejection_sample_method!r}.")
    if spec.synthetic_acceptance_rates is not None or spec.synthetic_acceptance_length is not None:
        raise ValueError("speculative_config.synthetic_acceptance_rates / "
                         "synthetic_acceptance_length are only valid with "
                         "rejection_sample_method='synthetic'.")
    if spec.num_speculative_tokens_per_batch_size is not None:
        spec.num_speculative_tokens_per_batch_size = validate_and_normalize_dynamic_sd_schedule(
            spec.num_speculative_tokens_per_batch_size)


def validate_and_normalize_dynamic_sd_schedule(schedule: object) -> list[tuple[int, int, int]]:
    """Dynamic k's schedule (``spec_decode/dynamic.py``), vLLM 0.32's checks
    (``vllm/v1/spec_decode/dynamic/utils.py``): a non-empty list of ``(range_start, range_end,
    k)``, ranges positive, ``start <= end``, ``k >= 0``, non-overlapping once sorted by start, and
    the first range starts at 1 so every batch size has a k. -> the entries as int tuples, sorted
    by start."""
    name = "speculative_config.num_speculative_tokens_per_batch_size"
    if not isinstance(schedule, list) or not schedule:
        raise ValueError(f"{name} must be a non-empty list of (range_start, range_end, "
                         f"num_speculative_tokens) entries, got {schedule!r}.")
    parsed: list[tuple[int, int, int]] = []
    for entry in schedule:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise ValueError(f"each {name} entry must be a 3-item sequence (range_start, "
                             f"range_end, num_speculative_tokens), got {entry!r}.")
        start, end, k = (int(v) for v in entry)
        if start <= 0 or end <= 0:
            raise ValueError(f"{name}: batch-size range ({start}, {end}) must be positive.")
        if start > end:
            raise ValueError(f"{name}: range start must be <= end in ({start}, {end}, {k}).")
        if k < 0:
            raise ValueError(f"{name}: the number of speculative tokens must be >= 0, got {k}.")
        parsed.append((start, end, k))
    parsed.sort(key=lambda e: e[0])
    previous_end = 0
    for start, end, _ in parsed:
        if start <= previous_end:
            raise ValueError(f"{name}: batch-size ranges must not overlap, got {parsed}.")
        previous_end = end
    if parsed[0][0] != 1:
        raise ValueError(f"{name}: the first range must start at 1 so that every batch size has "
                         f"a k, got {parsed}.")
    return parsed


def check_suffix_options(spec: SpeculativeFields) -> None:
    """vLLM 0.32's ``_validate_suffix_decoding`` ranges (config/speculative.py); no draft model."""
    for name, kind, lo, hi in (("max_tree_depth", int, 1, None),
                               ("max_cached_requests", int, 0, None),
                               ("max_spec_factor", float, 0, None),
                               ("min_token_prob", float, 0, 1)):
        value = getattr(spec, "suffix_decoding_" + name)
        if (isinstance(value, bool) or not isinstance(value, (kind, int)) or value < lo
                or (hi is not None and value > hi)):
            allowed = f"in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}" \
                if kind is int else f">= {lo}"
            raise ValueError(f"speculative_config.suffix_decoding_{name} must be {allowed}, "
                             f"got {value!r}.")
    if spec.model is not None or spec.draft_num_layers is not None:
        raise ValueError("speculative_config method 'suffix' drafts from the requests' own "
                         "tokens: it takes no 'model' or 'draft_num_layers'.")


def check_draft_num_layers(spec: SpeculativeFields, hf_config: Any) -> None:
    """A self-draft keeps at least one of the target's layers and drops at least one."""
    n = hf_config.num_hidden_layers
    if not 1 <= spec.draft_num_layers <= n - 1:
        raise ValueError(f"speculative_config.draft_num_layers must be in [1, {n - 1}] "
                         f"for this {n}-layer model, got {spec.draft_num_layers}.")
