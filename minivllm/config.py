"""Engine configuration, mirroring vllm/config/ (DeviceConfig, ModelConfig, CacheConfig,
SchedulerConfig, SpeculativeConfig, KVTransferConfig, VllmConfig).

Every ``__post_init__`` validates its fields and raises ``ValueError`` naming the field and the allowed
values, so a bad argument fails before any model weights are read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from minivllm.kv_transfer_options import check_kv_transfer_options
from minivllm.speculative_options import check_draft_num_layers, check_drafter_options

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "medusa", "suffix")
# Methods whose drafter is a trained head over the target's hidden states (DESIGN 5.1).
LEARNED_DRAFTER_METHODS = ("eagle", "eagle3", "medusa")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
ATTENTION_BACKENDS = ("auto", "torch", "cpu_attn", "triton")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class DeviceConfig:
    """vLLM's DeviceConfig (vllm/config/device.py), with the attention backend: ``"auto"`` becomes
    ``"cuda"`` when a GPU is visible, else ``"cpu"``; the backend ``"auto"`` becomes ``"triton"``
    on a GPU, else ``"cpu_attn"``."""
    device: str = "auto"
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.device == "auto":
            import torch
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}.")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device.startswith("cuda") else "cpu_attn"
        if self.attention_backend == "triton":
            # A Triton that cannot run here (e.g. TRITON_INTERPRET=0 on a CPU) fails now, with the
            # fix, rather than inside the first forward pass.
            from minivllm.triton_utils import check_triton_backend
            check_triton_backend(self.device)


@dataclass
class ModelConfig:
    model: str
    dtype: str = "auto"
    max_model_len: Optional[int] = None   # resolved from the checkpoint when None
    skip_tokenizer_init: bool = False
    seed: int = 0
    # vLLM's: which numbers logprobs return ("raw_logprobs", "raw_logits", "processed_logprobs",
    # "processed_logits"), and the most a request may ask for (-1, the whole vocabulary, is allowed).
    logprobs_mode: str = "raw_logprobs"
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        from minivllm.sampling_params import check_logprobs_mode
        check_logprobs_mode(self.logprobs_mode)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}.")

    def verify_with_hf_config(self, hf_config: Any) -> None:
        """vLLM's ``_get_and_verify_max_len``: the checkpoint's ``max_position_embeddings`` is
        the default and the limit of ``max_model_len``."""
        limit = int(getattr(hf_config, "max_position_embeddings", 2048))
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}.")


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: Optional[int] = None
    # Memory for the KV cache when num_gpu_blocks_override is not given.
    kv_cache_memory_bytes: Optional[int] = None
    num_gpu_blocks: Optional[int] = None      # resolved by the worker

    def __post_init__(self) -> None:
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
            raise ValueError(
                f"block_size must be a positive power of two (1, 2, 4, ..., 256), got {bs!r}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError("num_gpu_blocks_override must be at least 2 (block 0 is the reserved "
                             f"null block), got {self.num_gpu_blocks_override}.")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    # vLLM 0.32's SchedulerConfig.async_scheduling: AsyncScheduler (core/sched/async_scheduler.py).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")


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
    # to vLLM's "synthetic" mode, which minivllm refuses by name (speculative_options.py).
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
        # The options of the methods that came after the article's n-gram, checked on every
        # construction, whatever the other fields are (speculative_options.py).
        check_drafter_options(self)

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
        """The checks that need the checkpoint's config: a self-draft's layer count (beside, in
        speculative_options.py, as the draft model's other options)."""
        if self.draft_num_layers is not None:
            check_draft_num_layers(self, hf_config)


@dataclass
class KVTransferConfig:
    """vLLM's KVTransferConfig (vllm/config/kv_transfer.py): which connector moves KV between
    instances, and this instance's role.

    ``kv_load_failure_policy``: what a KV load that fails after the scheduler counted its tokens
    as computed costs. ``"recompute"`` (minivllm's default): the request is cut back to its first
    bad block and computes the rest itself, so a failure costs compute, never a request.
    ``"fail"`` (vLLM 0.32's default): the request finishes with ``FINISHED_ERROR``
    (``finish_reason == "error"``), the engine lives on and the server answers with an error.
    ``kv_lease_duration``: seconds a producer holds a finished request's blocks for a pull
    connector's reader before it frees them unread (vLLM's name and default, 30 s)."""
    kv_connector: Optional[str] = None
    kv_role: Optional[str] = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # The worker's connector context manager (worker/kv_connector_model_runner_mixin.py): "article"
    # (start_load_kv on enter, wait_for_save on exit, none on a step without a forward) or
    # "vllm_today" (vLLM 0.32: start_load_kv on enter only with has_sync_kv_loads, else after the
    # forward; wait_for_save on every step, also without a forward). minivllm-only field.
    kv_connector_context: str = "article"
    kv_load_failure_policy: str = "recompute"
    kv_lease_duration: float = 30.0

    def __post_init__(self) -> None:
        if self.kv_connector is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}.")
        # The options the article's example leaves at their defaults, checked on every
        # construction (kv_transfer_options.py).
        check_kv_transfer_options(self)

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    speculative_config: Optional[SpeculativeConfig] = None
    kv_transfer_config: Optional[KVTransferConfig] = None
    device: str = "cpu"
    attention_backend: str = "torch"
    # Filled by the loader: the checkpoint's transformers config, and the resolved local path.
    hf_config: Any = None
    model_path: Optional[str] = None
