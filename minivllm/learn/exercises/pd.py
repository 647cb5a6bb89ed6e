"""Checks for the disaggregated prefill/decode exercises in ``notebooks/07_pd_exercises.ipynb``.

| exercise | student writes | checked against |
|---|---|---|
| load or recompute | ``decode_load_plan(block_size, num_prompt_tokens, num_local_hit_tokens)`` | hand cases; ``SharedStorageConnector``'s ``align_to_block_size`` rule |
| your own KV connector | ``class MyKVConnector(InMemoryConnector)``: ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta`` | real ``LLM`` instances run through it (``kv_producer``, ``kv_consumer``, then ``kv_both``, the article's role), against a plain ``LLM`` |

``InMemoryConnector`` is the worker half, given: the "KV-cache service" is the dict ``STORE``
(stored prefix token ids -> {layer name: ``[2, n, num_kv_heads * head_dim]``}), shared by every
instance in this process. The student writes the scheduler half (article steps "Cache lookup",
"State update", "Build metadata object"), as vLLM's ``SharedStorageConnector`` does.
"""
from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from minivllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorMetadata
from minivllm.learn.exercises.spec import ExerciseCheckError, _call, _fail, _passed

STORE: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}


# --------------------------------------------------------------------------- 1. load or recompute
def reference_decode_load_plan(block_size: int, num_prompt_tokens: int, num_local_hit_tokens: int):
    """(positions loaded from the store, positions the decode instance computes)."""
    from minivllm.distributed.kv_transfer.shared_storage_connector import align_to_block_size
    stored = align_to_block_size(num_prompt_tokens, block_size)   # whole blocks before the last token
    start = max(stored, num_local_hit_tokens)
    return list(range(num_local_hit_tokens, stored)), list(range(start, num_prompt_tokens))


def _plan_hint(kw: dict, got: Any) -> str:
    load = got[0] if isinstance(got, (list, tuple)) and len(got) == 2 else []
    if num_prompt_tokens_minus_1_in(load, kw):
        return "the last prompt token is always recomputed: its logits give the first output token."
    if kw["num_local_hit_tokens"] and load and min(load) < kw["num_local_hit_tokens"]:
        return "tokens already in the local prefix cache are not loaded again."
    if load and (max(load) + 1) % kw["block_size"]:
        return "only whole blocks are stored and loaded."
    return ""


def num_prompt_tokens_minus_1_in(load: Any, kw: dict) -> bool:
    return kw["num_prompt_tokens"] - 1 in list(load)


def check_decode_load_plan(fn: Callable) -> bool:
    name = "decode_load_plan"
    hand = [  # (case, block_size, num_prompt_tokens, num_local_hit_tokens, expected load, recompute)
        ("the article's prompt: 5 tokens, shorter than a block", 16, 5, 0, [], list(range(5))),
        ("17 tokens: one whole block before the last token", 16, 17, 0, list(range(16)), [16]),
        ("exactly two blocks: the last token's block is recomputed", 16, 32, 0, list(range(16)),
         list(range(16, 32))),
        ("a local prefix hit of one block", 16, 40, 16, list(range(16, 32)), list(range(32, 40))),
        ("the local hit covers everything stored", 4, 13, 12, [], [12]),
    ]
    for case, bs, n, hit, load, recompute in hand:
        kw = dict(block_size=bs, num_prompt_tokens=n, num_local_hit_tokens=hit)
        got = _normalise(_call(name, fn, case, kw))
        if got != (load, recompute):
            _fail(name, case, kw, (load, recompute), got, _plan_hint(kw, got))
    rng, n_ref = random.Random(0), 40
    for i in range(n_ref):
        bs = rng.choice([1, 2, 4, 16])
        n = rng.randint(1, 80)
        hit = rng.randint(0, (n - 1) // bs) * bs
        kw = dict(block_size=bs, num_prompt_tokens=n, num_local_hit_tokens=hit)
        want = tuple(reference_decode_load_plan(**kw))
        got = _normalise(_call(name, fn, f"reference #{i}", kw))
        if got != want:
            _fail(name, f"reference #{i}", kw, want, got, _plan_hint(kw, got))
    return _passed(name, len(hand), n_ref, "SharedStorageConnector's block rule")


def _normalise(got: Any) -> Any:
    try:
        load, recompute = got
        return [int(t) for t in load], [int(t) for t in recompute]
    except (TypeError, ValueError):
        return got


# --------------------------------------------------------------------------- 2. a KV connector
@dataclass
class InMemoryReqMeta:
    req_id: str
    token_ids: list[int]        # the stored prefix: a whole number of blocks
    block_ids: list[int]        # the request's blocks, in order; the first len(token_ids)/bs hold it
    is_store: bool


@dataclass
class InMemoryConnectorMetadata(KVConnectorMetadata):
    requests: list[InMemoryReqMeta] = field(default_factory=list)

    def add_request(self, req_id: str, token_ids: list[int], block_ids: list[int],
                    is_store: bool) -> None:
        self.requests.append(InMemoryReqMeta(req_id, list(token_ids), list(block_ids), is_store))

    def describe(self) -> list[dict[str, Any]]:
        return [{"req_id": r.req_id, "is_store": r.is_store, "tokens": len(r.token_ids),
                 "block_ids": r.block_ids} for r in self.requests]


class InMemoryConnector(KVConnectorBase_V1):
    """The worker half of a connector whose "external server" is the dict ``STORE``.

    Given to the scheduler half: ``self.block_size``, ``self.kv_role``, ``self.is_producer``,
    ``self.is_consumer`` (both true under ``kv_both``),
    ``self.is_stored(token_ids)``, ``self.requests_need_load`` (an empty dict for its own use).
    ``build_connector_meta`` returns an
    ``InMemoryConnectorMetadata``; each request in it is stored (``is_store=True``: its first
    ``len(token_ids)`` tokens, computed this step) or loaded into its blocks (``is_store=False``).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.kv_role = ktc.kv_role
        self.is_producer, self.is_consumer = ktc.is_kv_producer, ktc.is_kv_consumer
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._pending: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
        self.loaded_tokens: dict[str, int] = {}     # req_id -> tokens written from STORE
        # For the scheduler half: req_id -> what to load, from update_state_after_alloc until
        # build_connector_meta puts it into the step's metadata.
        self.requests_need_load: dict[str, Any] = {}

    def is_stored(self, token_ids: list[int]) -> bool:
        return tuple(token_ids) in STORE

    def _slots(self, req: InMemoryReqMeta) -> torch.Tensor:
        """Paged-cache slots of positions ``[0, len(token_ids))``: ``[n]`` int64."""
        n, bs = len(req.token_ids), self.block_size
        if n % bs or len(req.block_ids) * bs < n:
            raise ValueError(f"request {req.req_id}: {n} tokens is not a whole number of blocks "
                             f"of {bs}, or {len(req.block_ids)} blocks cannot hold them.")
        pos = torch.arange(n)
        return torch.tensor(req.block_ids, dtype=torch.long)[pos // bs] * bs + pos % bs

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        for req in self._get_connector_metadata().requests:
            if req.is_store:
                continue
            stored = STORE.get(tuple(req.token_ids))
            if stored is None:
                raise RuntimeError(f"request {req.req_id}: asked to load {len(req.token_ids)} "
                                   "tokens that were never stored.")
            slots = self._slots(req)
            for name, kv in self._kv_caches.items():
                kv.view(2, -1, kv.shape[3] * kv.shape[4])[:, slots] = stored[name].to(kv.dtype)
            self.loaded_tokens[req.req_id] = len(req.token_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        for req in self._get_connector_metadata().requests:
            if req.is_store:
                flat = kv_layer.view(2, -1, kv_layer.shape[3] * kv_layer.shape[4])
                self._pending.setdefault(tuple(req.token_ids), {})[layer_name] = (
                    flat[:, self._slots(req)].cpu().clone())

    def wait_for_save(self) -> None:
        STORE.update(self._pending)
        self._pending = {}

    def get_stats(self) -> dict[str, Any]:
        return {"num_loaded_tokens": sum(self.loaded_tokens.values())}


_TINY: dict[str, str] = {}


def _tiny_model() -> str:
    """A 2-layer random Llama (no tokenizer), written once per process."""
    if "dir" not in _TINY:
        from transformers import LlamaConfig, LlamaForCausalLM
        path = tempfile.mkdtemp(prefix="minivllm_exercise_model_")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=128,
                                         initializer_range=0.1)).save_pretrained(path)
        _TINY["dir"] = path
    return _TINY["dir"]


def _run(model: str, prompts: list[list[int]], max_tokens: int, ktc: Any = None):
    from minivllm import LLM, SamplingParams
    llm = LLM(model=model, skip_tokenizer_init=True, block_size=4, kv_transfer_config=ktc,
              num_gpu_blocks_override=64, max_num_seqs=8, max_num_batched_tokens=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return llm, outs


def _checked(cls: type) -> type:
    """``cls`` with its lookup answer compared, call by call, with the rule it must follow: by
    role, a pure producer answers 0; a consumer and ``kv_both`` look the prompt up."""
    class Checked(cls):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            got = super().get_num_new_matched_tokens(request, num_computed_tokens)
            prompt = request.prompt_token_ids
            n = (len(prompt) - 1) // self.block_size * self.block_size
            hit = self.is_consumer and n > num_computed_tokens and self.is_stored(prompt[:n])
            want = (n - num_computed_tokens if hit else 0, False)
            if tuple(got) != want:
                raise ExerciseCheckError(
                    f"{cls.__name__}.get_num_new_matched_tokens is wrong under "
                    f"kv_role={self.kv_role!r}: prompt of {len(prompt)} "
                    f"tokens, block_size {self.block_size}, num_computed_tokens="
                    f"{num_computed_tokens} (local prefix-cache hits), stored prefix: "
                    f"{n if self.is_stored(prompt[:n]) else 0} tokens; expected {want}, got {got}."
                    + ("\n  hint: return only the tokens beyond the local hits." if
                       num_computed_tokens and got and got[0] == n else "")
                    + ("\n  hint: kv_both (the article's configuration) is a producer AND a "
                       "consumer: it must look the prompt up like a consumer. Decide by "
                       "is_consumer, not by is_producer." if self.is_producer and self.is_consumer
                       and want[0] and not got[0] else ""))
            return got
    return Checked


def check_kv_connector(cls: type) -> bool:
    """Producer (max_tokens=1) then consumer through ``cls``; the consumer must load exactly the
    whole blocks before each prompt's last token, beyond its local prefix hits, and generate what
    a plain instance generates."""
    from minivllm.config import KVTransferConfig
    from minivllm.distributed.kv_transfer import KVConnectorFactory
    name = getattr(cls, "__name__", "MyKVConnector")
    if not (isinstance(cls, type) and issubclass(cls, InMemoryConnector)):
        raise ExerciseCheckError(f"{name} must be a class deriving from exercises.InMemoryConnector.")
    for method in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta"):
        if getattr(cls, method) is getattr(KVConnectorBase_V1, method):
            raise ExerciseCheckError(f"{name}.{method} is not written yet: write it, run its cell, "
                                     "then this check again.")
    rng = random.Random(1)
    p0 = [rng.randrange(256) for _ in range(13)]
    # p3 shares p0's first two blocks: the consumer finds them in its own prefix cache.
    prompts = [p0, [rng.randrange(256) for _ in range(8)], [7, 8, 9], p0[:8] + [5] * 10]
    expected_stored = {12, 4, 16}
    model = _tiny_model()
    registered = f"ExerciseConnector_{id(cls)}"
    KVConnectorFactory._registry.pop(registered, None)
    KVConnectorFactory.register_connector(registered, _checked(cls))
    STORE.clear()
    try:
        plain = [o.outputs[0].token_ids for o in _run(model, prompts, 5)[1]]
        try:
            _run(model, prompts, 1, KVTransferConfig(kv_connector=registered, kv_role="kv_producer"))
            stored = {len(k) for k in STORE}
            if stored != expected_stored:
                raise ExerciseCheckError(
                    f"{name} on the producer: the store holds prefixes of {sorted(stored)} tokens, "
                    f"expected {sorted(expected_stored)} (prompts of {[len(p) for p in prompts]} "
                    "tokens, block_size 4: every whole block before the last prompt token, "
                    "is_store=True in build_connector_meta).")
            runs = [(role, *_run(model, prompts, 5, KVTransferConfig(kv_connector=registered,
                                                                    kv_role=role)))
                    for role in ("kv_consumer", "kv_both")]
        except NotImplementedError:
            raise ExerciseCheckError(f"{name} is not written yet: replace `raise NotImplementedError` "
                                     "with your code, run its cell, then this check again.") from None
        except ExerciseCheckError:
            raise
        except Exception as e:
            raise ExerciseCheckError(f"{name}: the engine failed with {type(e).__name__}: {e}") from e
        for role, llm, outs in runs:
            _check_loads(name, role, llm, prompts, outs, plain)
    finally:
        STORE.clear()
        KVConnectorFactory._registry.pop(registered, None)
    print(f"\u2713 {name}: a producer, a consumer and a kv_both instance ran through it; "
          f"{len(prompts)} prompts loaded what was stored and generated what a plain instance "
          "generates.")
    return True


def _check_loads(name: str, role: str, llm: Any, prompts: list[list[int]], outs: list[Any],
                 plain: list[list[int]]) -> None:
    """Each prompt: the whole blocks before its last token not computed, all of them loaded from the
    store, and the output of a plain instance."""
    loaded = llm.llm_engine.engine_core.worker.kv_connector.loaded_tokens
    for i, (p, o) in enumerate(zip(prompts, outs)):
        want = (len(p) - 1) // 4 * 4
        want_loaded = want       # p3's load rewrites its two locally cached blocks: same KV
        got_loaded = loaded.get(o.request_id, 0)
        if o.num_cached_tokens != want or got_loaded != want_loaded:
            raise ExerciseCheckError(
                f"{name} under kv_role={role!r}, prompt {i} ({len(p)} tokens): expected {want} "
                f"tokens not computed, {want_loaded} of them loaded from the store; got "
                f"{o.num_cached_tokens} not computed, {got_loaded} loaded."
                + (" hint: num_computed_tokens are local prefix-cache hits; return only the "
                   "tokens beyond them." if i == 3 else ""))
        if o.outputs[0].token_ids != plain[i]:
            raise ExerciseCheckError(f"{name}: prompt {i} generated {o.outputs[0].token_ids} "
                                     f"after the load, a plain instance {plain[i]}: the loaded "
                                     "KV went into the wrong blocks.")
