"""The worker, mirroring vllm/v1/worker/gpu_worker.py: owns the device, the model runner and the
KV cache tensors.

Article steps here: spec decode "Setup": ``init_device()`` creates the drafter and the rejection
sampler (inside ``ModelRunner.__init__``), ``load_model()`` loads draft weights. P/D "Instantiation"
(the article's picture): ``init_device()`` → ``init_worker_distributed_environment()`` creates the
worker-role KV connector. vLLM today (0.32, v1/worker/gpu_worker.py): the connector needs the
``kv_cache_config``, so ``initialize_from_config(kv_cache_config)`` creates it, after KV profiling,
through ``ensure_kv_transfer_initialized(vllm_config, kv_cache_config)``;
``init_worker_distributed_environment`` there sets up only the encoder-cache transfer.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from minivllm.config import VllmConfig
from minivllm.core.sched.output import SchedulerOutput
from minivllm.utils import cdiv, resolve_auto_dtype, resolve_obj_by_qualname
from minivllm.worker.model_runner import ModelRunner, ModelRunnerOutput

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def init_worker_distributed_environment(vllm_config: VllmConfig) -> Any:
    """Single process, single device: the only distributed state is the KV connector (role WORKER),
    or ``None`` without a ``kv_transfer_config``. Created here as in the article; vLLM 0.32 creates
    it later, in ``Worker.initialize_from_config`` (see the module docstring)."""
    ktc = vllm_config.kv_transfer_config
    if ktc is None or not ktc.kv_connector:
        return None   # no P/D: the KV-transfer package is never loaded
    from minivllm.distributed.kv_transfer import ensure_kv_transfer_initialized
    return ensure_kv_transfer_initialized(vllm_config)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The model's ``torch.dtype``; ``"auto"`` as ``utils.resolve_auto_dtype`` says (bfloat16 on
    CUDA, float32 elsewhere)."""
    return _DTYPES[resolve_auto_dtype(dtype, device)]


def _defers_finalize(c: VllmConfig) -> bool:
    spec, ktc = c.speculative_config, c.kv_transfer_config
    return bool(spec and spec.needs_lookahead_slots and ktc and ktc.kv_connector)


# The runner's mixins, each (when it applies, the mixin), in method-resolution order: the first
# listed overrides the later ones. vLLM 0.32's variants (worker/vllm_today/), then the KV
# connector's half, which a runner without a connector does without.
MODEL_RUNNER_MIXINS: tuple[tuple[Callable[[VllmConfig], bool], str], ...] = (
    (lambda c: c.scheduler_config.async_scheduling,
     "minivllm.worker.vllm_today.async_scheduling.AsyncSchedulingMixin"),
    (_defers_finalize, "minivllm.worker.vllm_today.defer_finalize.DeferFinalizeMixin"),
    (lambda c: c.kv_transfer_config is not None
     and c.kv_transfer_config.kv_connector_context == "vllm_today",
     "minivllm.worker.vllm_today.kv_connector_context.VllmTodayKVConnectorMixin"),
    (lambda c: c.speculative_config is not None
     and c.speculative_config.draft_sample_method == "probabilistic",
     "minivllm.worker.vllm_today.draft_probs.ProbabilisticDraftsMixin"),
    (lambda c: bool(c.speculative_config and c.speculative_config.num_speculative_tokens_per_batch_size),
     "minivllm.worker.vllm_today.dynamic_k.DynamicSpecTokensMixin"),
    # The article's KV-connector half, under the 0.32 overrides above: only with a connector.
    (lambda c: c.kv_transfer_config is not None and bool(c.kv_transfer_config.kv_connector),
     "minivllm.worker.kv_connector_model_runner_mixin.KVConnectorModelRunnerMixin"),
)


def get_model_runner_cls(vllm_config: VllmConfig) -> type:
    """The article's ``ModelRunner``, or a subclass of it with the mixins this configuration asks
    for (the KV connector's half, vLLM 0.32's variants; chosen once, at construction)."""
    mixins = tuple(resolve_obj_by_qualname(name) for applies, name in MODEL_RUNNER_MIXINS
                   if applies(vllm_config))
    if not mixins:
        return ModelRunner
    name = "".join(m.__name__.removesuffix("Mixin") for m in mixins) + "ModelRunner"
    return type(name, mixins + (ModelRunner,), {})


class Worker:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        self.model_runner: Optional[ModelRunner] = None
        self.kv_connector: Any = None

    def init_device(self) -> None:
        self.device = torch.device(self.vllm_config.device)
        self.dtype = resolve_dtype(self.vllm_config.model_config.dtype, self.device)
        torch.manual_seed(self.vllm_config.model_config.seed)
        self.kv_connector = init_worker_distributed_environment(self.vllm_config)
        self.model_runner = get_model_runner_cls(self.vllm_config)(
            self.vllm_config, self.device, self.dtype, kv_connector=self.kv_connector)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_available_blocks(self) -> int:
        cache = self.vllm_config.cache_config
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        per_block = self.model_runner.kv_cache_bytes_per_block()
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.5)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        sched = self.vllm_config.scheduler_config
        max_model_len = self.vllm_config.model_config.max_model_len
        # Never more than every sequence at full length could use (+1 for the null block).
        needed = sched.max_num_seqs * cdiv(max_model_len, cache.block_size) + 1
        return max(2, min(budget // per_block, needed))

    def initialize_cache(self, num_gpu_blocks: int) -> None:
        self.vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        self.model_runner.initialize_kv_cache(num_gpu_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """The forward; ``None`` unless the step had nothing to run (then ``sample_tokens``
        finishes it, as in vLLM 0.32's worker)."""
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens()

    def take_draft_token_ids(self) -> Optional[dict[str, list[int]]]:
        return self.model_runner.take_draft_token_ids()
