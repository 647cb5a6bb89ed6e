"""``SpeculativeConfig``: the article's ``speculative_config`` (n-gram prompt lookup, k drafts per
step) and the methods after it (draft model, EAGLE, EAGLE-3, Medusa, suffix decoding) with their
drafting and verification options; mirrors vllm/config/speculative.py (``_verify_args``,
``_validate_suffix_decoding``), under vLLM 0.32's names and checks. The article's speculative
decoding example: ``LLM(speculative_config={"method": "ngram", ...})``, the drafter ``spec.setup``
creates.

Every field is checked on every construction, whatever the others are: a bad value is a
``ValueError`` naming ``speculative_config.<field>`` and what it allows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "suffix")
# Methods whose drafter is a trained head over the target's hidden states: ``model`` is a
# vLLM-format head directory (config.json + model.safetensors).
LEARNED_DRAFTER_METHODS = ("eagle", "eagle3", "medusa")
NGRAM_MATCH_RULES = ("first", "last")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "block")


@dataclass
class SpeculativeConfig:
    """``speculative_config`` as the article passes it, plus minivllm's ``ngram_match`` and draft options."""
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    ngram_match: str = "first"
    # draft_model: a smaller checkpoint, same tokenizer; eagle/eagle3/medusa: a vLLM-format head
    # directory (left out on the default model: the heads shipped in the package)
    model: Optional[str] = None
    draft_num_layers: Optional[int] = None  # draft_model: self-draft from the target's first N layers
    # vLLM 0.32's draft_sample_method (eagle, eagle3, draft_model): "greedy" drafts by argmax and
    # hands no draft_probs (p_draft = 1); "probabilistic" samples each draft from the drafter's own
    # distribution at the request's temperature/top-k/top-p and hands those probabilities to the
    # rejection sampler (the article's p_target / p_draft rule with a learned drafter).
    draft_sample_method: str = "greedy"
    suffix_decoding_max_tree_depth: int = 24   # method "suffix": vLLM 0.32's names and defaults
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Verification past the article (vLLM 0.32's names): "standard" is the article's token-wise
    # rule, "block" block verification (sample/rejection_block.py); synthetic_acceptance_* belong
    # to vLLM's "synthetic" mode, which minivllm refuses by name (_verify_args).
    rejection_sample_method: str = "standard"
    synthetic_acceptance_rates: Optional[list[float]] = None
    synthetic_acceptance_length: Optional[float] = None
    # Dynamic k: [(start, end, k), ...] picks this step's k from the batch size (spec_decode/dynamic.py)
    num_speculative_tokens_per_batch_size: Optional[list] = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                             f"got {self.method!r}.")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer >= 1, "
                             f"got {self.num_speculative_tokens!r}.")
        if self.method == "ngram":
            # vLLM: if only one bound is given the other copies it; if neither, both are 5.
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = 5
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            if lo < 1:
                raise ValueError(f"speculative_config.prompt_lookup_min must be >= 1, got {lo}.")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                                 f"prompt_lookup_max ({hi}).")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        self._verify_args()

    def _verify_args(self) -> None:
        """The options of the methods that came after the article's n-gram (and n-gram's
        minivllm-only ``ngram_match``), vLLM 0.32's checks on ``rejection_sample_method``, and
        the dynamic-k schedule, normalized. minivllm has no watermarking, so vLLM's "watermarking
        only with 'standard'" has nothing to check here."""
        if self.method == "ngram" and self.ngram_match not in NGRAM_MATCH_RULES:
            raise ValueError(f"speculative_config.ngram_match must be one of "
                             f"{NGRAM_MATCH_RULES}, got {self.ngram_match!r}.")
        if self.method == "draft_model":
            if (self.model is None) == (self.draft_num_layers is None):
                raise ValueError("speculative_config for method 'draft_model' needs exactly one of "
                                 "'model' (a draft checkpoint) or 'draft_num_layers' (a self-draft).")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"speculative_config.draft_sample_method must be one of "
                             f"{DRAFT_SAMPLE_METHODS}, got {self.draft_sample_method!r}.")
        if (self.draft_sample_method == "probabilistic"
                and self.method not in ("eagle", "eagle3", "draft_model")):
            raise ValueError("speculative_config.draft_sample_method='probabilistic' needs method "
                             f"'eagle', 'eagle3' or 'draft_model', not {self.method!r} (its drafts "
                             "have no distribution).")
        if self.method == "suffix":   # vLLM checks these for this method only
            self._validate_suffix_decoding()
        if self.rejection_sample_method == "synthetic":
            raise ValueError("speculative_config.rejection_sample_method='synthetic' (vLLM's "
                             "synthetic acceptance rates, a benchmarking mode that accepts drafts "
                             "at a set rate whatever the models say) is not built in minivllm; use "
                             "'standard' (the article's token-wise rule) or 'block' (block "
                             "verification).")
        if self.rejection_sample_method not in REJECTION_SAMPLE_METHODS:
            raise ValueError(f"speculative_config.rejection_sample_method must be one of "
                             f"{REJECTION_SAMPLE_METHODS}, got {self.rejection_sample_method!r}.")
        if self.synthetic_acceptance_rates is not None or self.synthetic_acceptance_length is not None:
            raise ValueError("speculative_config.synthetic_acceptance_rates / "
                             "synthetic_acceptance_length are only valid with "
                             "rejection_sample_method='synthetic'.")
        if self.num_speculative_tokens_per_batch_size is not None:
            self.num_speculative_tokens_per_batch_size = validate_and_normalize_dynamic_sd_schedule(
                self.num_speculative_tokens_per_batch_size)
        if self.method != "draft_model" and self.draft_num_layers is not None:
            raise ValueError("speculative_config.draft_num_layers is for method 'draft_model' "
                             f"only, not {self.method!r}.")

    def _validate_suffix_decoding(self) -> None:
        """vLLM 0.32's ``_validate_suffix_decoding`` ranges; suffix decoding has no draft model."""
        for name, kind, lo, hi in (("max_tree_depth", int, 1, None),
                                   ("max_cached_requests", int, 0, None),
                                   ("max_spec_factor", float, 0, None),
                                   ("min_token_prob", float, 0, 1)):
            value = getattr(self, "suffix_decoding_" + name)
            if (isinstance(value, bool) or not isinstance(value, (kind, int)) or value < lo
                    or (hi is not None and value > hi)):
                allowed = f"in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}" \
                    if kind is int else f">= {lo}"
                raise ValueError(f"speculative_config.suffix_decoding_{name} must be {allowed}, "
                                 f"got {value!r}.")
        if self.model is not None or self.draft_num_layers is not None:
            raise ValueError("speculative_config method 'suffix' drafts from the requests' own "
                             "tokens: it takes no 'model' or 'draft_num_layers'.")

    def use_eagle(self) -> bool:
        """vLLM's ``SpeculativeConfig.use_eagle``: drives the drafter type, the lookahead slots and
        the prefix-cache rule (recompute the last matched block)."""
        return self.method in ("eagle", "eagle3")

    @property
    def needs_lookahead_slots(self) -> bool:
        # EAGLE, EAGLE-3 and the draft model write KV for their own drafts, so their slots must
        # exist when they propose: vLLM 0.32 gives all three k lookahead tokens (config/vllm.py,
        # num_lookahead_tokens). n-gram and Medusa write no KV and reserve none, as in vLLM.
        return self.method == "draft_model" or self.use_eagle()

    @classmethod
    def from_dict(cls, cfg: "SpeculativeConfig | dict[str, Any] | None") -> Optional["SpeculativeConfig"]:
        if cfg is None or isinstance(cfg, SpeculativeConfig):
            return cfg
        known = set(cls.__dataclass_fields__)
        unknown = set(cfg) - known
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}; "
                             f"allowed: {sorted(known)}.")
        return cls(**cfg)

    def verify_with_hf_config(self, hf_config: Any) -> None:
        """The checks that need the checkpoint's config: a self-draft keeps at least one of the
        target's layers and drops at least one."""
        if self.draft_num_layers is not None:
            n = hf_config.num_hidden_layers
            if not 1 <= self.draft_num_layers <= n - 1:
                raise ValueError(f"speculative_config.draft_num_layers must be in [1, {n - 1}] "
                                 f"for this {n}-layer model, got {self.draft_num_layers}.")


def validate_and_normalize_dynamic_sd_schedule(schedule: object) -> list[tuple[int, int, int]]:
    """Dynamic k's schedule (``spec_decode/dynamic.py``), vLLM 0.32's checks, a free function as in
    vLLM (``vllm/v1/spec_decode/dynamic/utils.py``): a non-empty list of ``(range_start,
    range_end, k)``, ranges positive, ``start <= end``, ``k >= 0``, non-overlapping once sorted by
    start, and the first range starts at 1 so every batch size has a k. -> the entries as int
    tuples, sorted by start."""
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
