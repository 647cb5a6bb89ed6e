"""The checks of the P/D assignment ``pd`` (article, "Disaggregated P/D"). Source notebook:
``notebooks/course/source/pd/07_pd_exercises.ipynb``; the student's copy, as nbgrader releases it:
``notebooks/07_pd_exercises.ipynb``.

1. load or recompute: ``decode_load_plan(block_size, num_prompt_tokens, num_local_hit_tokens)``,
   against hand cases and ``SharedStorageConnector``'s ``align_to_block_size`` rule;
2. the scheduler half of a connector: ``class MyKVConnector(InMemoryConnector)`` with
   ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``, run by
   real ``LLM`` instances (``kv_producer``, ``kv_consumer``, then ``kv_both``, the article's
   role) against a plain ``LLM``;
3. the worker half of a connector: ``class MyWorkerConnector(InMemorySchedulerConnector)`` with
   ``start_load_kv``, ``save_kv_layer``, ``wait_for_save`` (and the helper ``slot_mapping``), run
   by a real producer and consumer ``LLM`` against a plain one, then hand-made steps whose blocks
   are out of order.

Both connector exercises move KV through the same "KV-cache service", the dict ``STORE`` (stored
prefix token ids -> {layer name: ``[2, n, num_kv_heads * head_dim]``}), shared by every instance in
this process, and split one connector into its halves as vLLM's ``ExampleConnector``
(vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py; minivllm's
``SharedStorageConnector``) has them, with a dict for its folder:

- ``InMemoryConnectorBase``: what both halves share (roles, block size, the store, the caches);
- ``InMemoryConnector``: the worker half, given to the scheduler-half exercise;
- ``InMemorySchedulerConnector``: the scheduler half, given to the worker-half exercise.

Every check prints one ``✓`` line and returns ``None``, or raises ``ExerciseCheckError``; it writes
nothing on stderr (the engine runs with ``use_tqdm=False``, warnings and progress bars silenced).
"""
from __future__ import annotations

import contextlib
import io
import random
import tempfile
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import torch

from minivllm.distributed.kv_transfer.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                   KVConnectorRole)
from minivllm.learn.exercises.registry import ExerciseCheckError, exercise
from minivllm.learn.exercises.spec import _call, _fail

STORE: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Nothing on stderr while a check runs (nbgrader scores a cell with stderr output 0): warnings
    ignored, and what a library writes on ``sys.stderr`` (a progress bar) dropped."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------- 1. load or recompute
def reference_decode_load_plan(block_size: int, num_prompt_tokens: int, num_local_hit_tokens: int):
    """(positions loaded from the store, positions the decode instance computes)."""
    from minivllm.distributed.kv_transfer.storage import align_to_block_size
    stored = align_to_block_size(num_prompt_tokens, block_size)   # blocks before the last token
    start = max(stored, num_local_hit_tokens)
    return list(range(num_local_hit_tokens, stored)), list(range(start, num_prompt_tokens))


def _plan_hint(kw: dict, got: Any) -> str:
    load = got[0] if isinstance(got, (list, tuple)) and len(got) == 2 else []
    if kw["num_prompt_tokens"] - 1 in list(load):
        return "the last prompt token is always recomputed: its logits give the first output token."
    if kw["num_local_hit_tokens"] and load and min(load) < kw["num_local_hit_tokens"]:
        return "tokens already in the local prefix cache are not loaded again."
    if load and (max(load) + 1) % kw["block_size"]:
        return "only whole blocks are stored and loaded."
    return ""


def _normalise(got: Any) -> Any:
    try:
        load, recompute = got
        return [int(t) for t in load], [int(t) for t in recompute]
    except (TypeError, ValueError):
        return got


# (case, block_size, num_prompt_tokens, num_local_hit_tokens, expected load, expected recompute)
LOAD_PLAN_CASES = {
    "visible": [
        ("the article's prompt: 5 tokens, shorter than a block", 16, 5, 0, [], list(range(5))),
        ("17 tokens: one whole block before the last token", 16, 17, 0, list(range(16)), [16]),
    ],
    "hidden": [
        ("exactly two blocks: the last token's block is recomputed", 16, 32, 0, list(range(16)),
         list(range(16, 32))),
        ("a local prefix hit of one block", 16, 40, 16, list(range(16, 32)), list(range(32, 40))),
        ("the local hit covers everything stored", 4, 13, 12, [], [12]),
    ],
}
NUM_LOAD_PLAN_REFERENCE_CASES = 40


@exercise(name="decode_load_plan", assignment="pd",
          article_step="Disaggregated P/D: cache lookup (whole blocks before the last prompt "
                       "token)",
          forbidden=tuple(f"minivllm.distributed.kv_transfer.{module}:align_to_block_size"
                          for module in ("storage", "shared_storage_connector"))
          + ("minivllm.learn.exercises.pd:reference_decode_load_plan",),
          mistakes=("the last prompt token's block stored when the prompt fills whole blocks "
                    "(num_prompt_tokens // block_size blocks instead of (num_prompt_tokens - 1) "
                    "// block_size)",
                    "the local prefix-cache hits loaded again (load from 0, not from "
                    "num_local_hit_tokens)"))
def check_decode_load_plan(fn: Callable, cases: str = "all") -> None:
    name = "decode_load_plan"
    hand = [c for part in ("visible", "hidden") if cases in (part, "all")
            for c in LOAD_PLAN_CASES[part]]
    for case, bs, n, hit, load, recompute in hand:
        kw = dict(block_size=bs, num_prompt_tokens=n, num_local_hit_tokens=hit)
        got = _normalise(_call(name, fn, case, kw))
        if got != (load, recompute):
            _fail(name, case, kw, (load, recompute), got, _plan_hint(kw, got))
    n_ref = NUM_LOAD_PLAN_REFERENCE_CASES if cases != "visible" else 0
    rng = random.Random(0)
    for i in range(n_ref):
        bs = rng.choice([1, 2, 4, 16])
        n = rng.randint(1, 80)
        hit = rng.randint(0, (n - 1) // bs) * bs
        kw = dict(block_size=bs, num_prompt_tokens=n, num_local_hit_tokens=hit)
        want = tuple(reference_decode_load_plan(**kw))
        got = _normalise(_call(name, fn, f"reference #{i}", kw))
        if got != want:
            _fail(name, f"reference #{i}", kw, want, got, _plan_hint(kw, got))
    print(f"\u2713 {name}: {len(hand)} hand-made cases"
          + (f" and {n_ref} cases against SharedStorageConnector's block rule" if n_ref else "")
          + " pass.")


# --------------------------------------------------------------------------- the connector's halves
@dataclass
class InMemoryReqMeta:
    req_id: str
    token_ids: list[int]        # the stored prefix: a whole number of blocks
    block_ids: list[int]        # the request's blocks, in order; the first n / bs hold the prefix
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


class InMemoryConnectorBase(KVConnectorBase_V1):
    """What both halves of the in-memory connector are given.

    ``self.block_size``, ``self.kv_role``, ``self.is_producer``, ``self.is_consumer`` (both true
    under ``kv_both``); ``self.store``: the "KV-cache service", ``STORE`` (stored prefix, as a
    tuple of token ids -> {layer name: ``[2, n, num_kv_heads * head_dim]``}, 0 = K, 1 = V);
    ``self.is_stored(token_ids)``. Scheduler side: ``self.requests_need_load`` (an empty dict for
    its own use). Worker side: ``self.kv_caches`` (layer name -> the paged cache ``[2, num_blocks,
    block_size, num_kv_heads, head_dim]``, set by ``register_kv_caches``), ``self.pending`` (an
    empty dict for its own use), ``self.loaded_tokens`` (req_id -> tokens written from the store).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.kv_role = ktc.kv_role
        self.is_producer, self.is_consumer = ktc.is_kv_producer, ktc.is_kv_consumer
        self.store = STORE
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.pending: dict[Any, Any] = {}
        self.loaded_tokens: dict[str, int] = {}
        # req_id -> what to load, from update_state_after_alloc until build_connector_meta puts it
        # into the step's metadata.
        self.requests_need_load: dict[str, Any] = {}

    def is_stored(self, token_ids: list[int]) -> bool:
        return tuple(token_ids) in self.store

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = dict(kv_caches)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Every layer is loaded in ``start_load_kv``: nothing to wait for."""

    def get_stats(self) -> dict[str, Any]:
        return {"num_loaded_tokens": sum(self.loaded_tokens.values())}


def _slots(block_ids: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """Paged-cache slots of positions ``[0, num_tokens)``: ``[num_tokens]`` int64."""
    pos = torch.arange(num_tokens)
    blocks = torch.tensor(block_ids, dtype=torch.long)
    return blocks[pos // block_size] * block_size + pos % block_size


def _rows(kv: torch.Tensor) -> torch.Tensor:
    """A paged cache ``[2, num_blocks, block_size, H, D]`` as ``[2, num_blocks * block_size,
    H * D]`` (a view: one row per slot)."""
    return kv.view(2, -1, kv.shape[3] * kv.shape[4])


class InMemoryConnector(InMemoryConnectorBase):
    """The worker half: ``start_load_kv`` writes stored rows into the blocks the metadata names,
    ``save_kv_layer`` gathers each layer's rows of the prefixes marked ``is_store``,
    ``wait_for_save`` publishes them. ``build_connector_meta`` (the scheduler half, the exercise)
    returns an ``InMemoryConnectorMetadata``; each request in it is stored (``is_store=True``: its
    first ``len(token_ids)`` tokens, computed this step) or loaded into its blocks
    (``is_store=False``)."""

    def _slots(self, req: InMemoryReqMeta) -> torch.Tensor:
        n, bs = len(req.token_ids), self.block_size
        if n % bs or len(req.block_ids) * bs < n:
            raise ValueError(f"request {req.req_id}: {n} tokens is not a whole number of blocks "
                             f"of {bs}, or {len(req.block_ids)} blocks cannot hold them.")
        return _slots(req.block_ids, n, bs)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        for req in self._get_connector_metadata().requests:
            if req.is_store:
                continue
            stored = self.store.get(tuple(req.token_ids))
            if stored is None:
                raise RuntimeError(f"request {req.req_id}: asked to load {len(req.token_ids)} "
                                   "tokens that were never stored.")
            slots = self._slots(req)
            for name, kv in self.kv_caches.items():
                _rows(kv)[:, slots] = stored[name].to(kv.dtype)
            self.loaded_tokens[req.req_id] = len(req.token_ids)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        for req in self._get_connector_metadata().requests:
            if req.is_store:
                self.pending.setdefault(tuple(req.token_ids), {})[layer_name] = (
                    _rows(kv_layer)[:, self._slots(req)].cpu().clone())

    def wait_for_save(self) -> None:
        self.store.update(self.pending)
        self.pending = {}


class InMemorySchedulerConnector(InMemoryConnectorBase):
    """The scheduler half: the stored prefix of a prompt is its whole blocks before its last token;
    a consumer (``kv_consumer``, ``kv_both``) looks it up, a producer stores it once."""

    def _stored_prefix(self, prompt_token_ids: list[int]) -> list[int]:
        return prompt_token_ids[:(len(prompt_token_ids) - 1) // self.block_size * self.block_size]

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        prefix = self._stored_prefix(request.prompt_token_ids)
        if not self.is_consumer or len(prefix) <= num_computed_tokens or not self.is_stored(prefix):
            return 0, False
        return len(prefix) - num_computed_tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.requests_need_load[request.request_id] = self._stored_prefix(
                request.prompt_token_ids)

    def build_connector_meta(self, scheduler_output: Any) -> InMemoryConnectorMetadata:
        meta = InMemoryConnectorMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            block_ids = list(req.block_ids[0])
            load = self.requests_need_load.pop(req.req_id, None)
            if load is not None:
                meta.add_request(req.req_id, load, block_ids, is_store=False)
                continue
            prefix = self._stored_prefix(req.prompt_token_ids)
            if self.is_producer and prefix and not self.is_stored(prefix):
                meta.add_request(req.req_id, prefix, block_ids, is_store=True)
        return meta


# --------------------------------------------------------------------------- real engine runs
_TINY: dict[str, Any] = {}


def _tiny_model() -> str:
    """A 2-layer random Llama (no tokenizer), written once per process."""
    if "dir" not in _TINY:
        from transformers import LlamaConfig, LlamaForCausalLM
        path = tempfile.mkdtemp(prefix="minivllm_exercise_model_")
        with torch.random.fork_rng(devices=[]), quiet():
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=128,
                                         initializer_range=0.1)).save_pretrained(path)
        _TINY["dir"] = path
    return _TINY["dir"]


def _run(model: str, prompts: list[list[int]], max_tokens: int, ktc: Any = None):
    from minivllm import LLM, SamplingParams
    with quiet():
        llm = LLM(model=model, skip_tokenizer_init=True, block_size=4, kv_transfer_config=ktc,
                  num_gpu_blocks_override=64, max_num_seqs=8, max_num_batched_tokens=256)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                            use_tqdm=False)
    return llm, outs


def _plain(prompts: list[list[int]]) -> list[list[int]]:
    """What a plain instance generates for ``prompts`` (5 tokens each), once per process."""
    key = ("plain", tuple(tuple(p) for p in prompts))
    if key not in _TINY:
        _TINY[key] = [list(o.outputs[0].token_ids) for o in _run(_tiny_model(), prompts, 5)[1]]
    return _TINY[key]


def _prompts() -> list[list[int]]:
    """Four prompts, block size 4: 13 tokens, 8 (exactly two blocks), 3 (nothing to store), and
    18 sharing the first's first two blocks (the consumer finds them in its own prefix cache)."""
    rng = random.Random(1)
    p0 = [rng.randrange(256) for _ in range(13)]
    return [p0, [rng.randrange(256) for _ in range(8)], [7, 8, 9], p0[:8] + [5] * 10]


def _pd_runs(name: str, cls: type, prompts: list[list[int]], roles: tuple[str, ...],
             store_hint: str) -> list[tuple[str, Any, Any]]:
    """A producer instance (``max_tokens=1``), then one instance per consumer role, through
    ``cls``: [(role, llm, outputs)]. The producer must have stored every whole block before each
    prompt's last token."""
    from minivllm.config import KVTransferConfig
    from minivllm.distributed.kv_transfer import KVConnectorFactory
    model = _tiny_model()
    expected_stored = sorted({(len(p) - 1) // 4 * 4 for p in prompts} - {0})
    registered = f"ExerciseConnector_{id(cls)}"
    KVConnectorFactory._registry.pop(registered, None)
    KVConnectorFactory.register_connector(registered, cls)
    STORE.clear()
    try:
        _run(model, prompts, 1, KVTransferConfig(kv_connector=registered, kv_role="kv_producer"))
        stored = sorted(len(k) for k in STORE)
        if stored != expected_stored:
            raise ExerciseCheckError(
                f"{name} on the producer: the store holds prefixes of {stored} tokens, expected "
                f"{expected_stored} (prompts of {[len(p) for p in prompts]} tokens, block_size 4: "
                f"every whole block before the last prompt token). hint: {store_hint}")
        return [(role, *_run(model, prompts, 5, KVTransferConfig(kv_connector=registered,
                                                                kv_role=role)))
                for role in roles]
    except NotImplementedError:
        raise ExerciseCheckError(f"{name} is not written yet: replace `raise NotImplementedError` "
                                 "with your code, run its cell, then this check again.") from None
    except ExerciseCheckError:
        raise
    except Exception as e:
        raise ExerciseCheckError(f"{name}: the engine failed with {type(e).__name__}: {e}") from e
    finally:
        STORE.clear()
        KVConnectorFactory._registry.pop(registered, None)


def _check_loads(name: str, role: str, llm: Any, prompts: list[list[int]], outs: list[Any],
                 plain: list[list[int]], output_hint: str) -> None:
    """Each prompt: the whole blocks before its last token not computed, all of them loaded from the
    store, and the output of a plain instance."""
    loaded = llm.llm_engine.engine_core.worker.kv_connector.loaded_tokens
    for i, (p, o) in enumerate(zip(prompts, outs)):
        want = (len(p) - 1) // 4 * 4
        want_loaded = want       # the fourth prompt's load rewrites its two cached blocks: same KV
        got_loaded = loaded.get(o.request_id, 0)
        if o.num_cached_tokens != want or got_loaded != want_loaded:
            raise ExerciseCheckError(
                f"{name} under kv_role={role!r}, prompt {i} ({len(p)} tokens): expected {want} "
                f"tokens not computed, {want_loaded} of them loaded from the store; got "
                f"{o.num_cached_tokens} not computed, {got_loaded} loaded."
                + (" hint: num_computed_tokens are local prefix-cache hits; return only the "
                   "tokens beyond them." if i == 3 else ""))
        if list(o.outputs[0].token_ids) != plain[i]:
            raise ExerciseCheckError(f"{name}: prompt {i} generated {list(o.outputs[0].token_ids)} "
                                     f"after the load, a plain instance {plain[i]}: {output_hint}")


def _not_written(name: str, cls: Any, base: type, methods: tuple[str, ...]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ExerciseCheckError(f"{name} must be a class deriving from exercises.{base.__name__}.")
    for method in methods:
        if getattr(cls, method) is getattr(KVConnectorBase_V1, method):
            raise ExerciseCheckError(f"{name}.{method} is not written yet: write it, run its cell, "
                                     "then this check again.")


# --------------------------------------------------------------------------- 2. the scheduler half
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


SCHEDULER_HALF = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta")


@exercise(name="MyKVConnector", assignment="pd",
          article_step="Disaggregated P/D: cache lookup, state update, build metadata object "
                       "(the connector's scheduler half)",
          forbidden=tuple(f"{module}:{cls}.{method}" for module, cls in (
              ("minivllm.distributed.kv_transfer.shared_storage_connector",
               "SharedStorageConnector"),
              ("minivllm.learn.exercises.pd", "InMemorySchedulerConnector"))
              for method in SCHEDULER_HALF),
          mistakes=("kv_both decided by is_producer: it answers 0 where it must look the prompt "
                    "up, so the article's configuration never loads",
                    "the whole stored prefix returned, not only the tokens beyond the local "
                    "prefix-cache hits (num_computed_tokens)"))
def check_MyKVConnector(cls: type, cases: str = "all") -> None:
    """Visible: a producer (``max_tokens=1``) then a consumer through ``cls`` on three prompts.
    Hidden: the same on four prompts (the fourth has a local prefix-cache hit), then a ``kv_both``
    instance. The consumers must load exactly the whole blocks before each prompt's last token
    and generate what a plain instance generates."""
    name = getattr(cls, "__name__", "MyKVConnector")
    _not_written(name, cls, InMemoryConnector, SCHEDULER_HALF)
    prompts = _prompts()
    parts = {"visible": (prompts[:3], ("kv_consumer",)),
             "hidden": (prompts, ("kv_consumer", "kv_both"))}
    for part in ("visible", "hidden"):
        if cases not in (part, "all"):
            continue
        ps, roles = parts[part]
        plain = _plain(ps)
        for role, llm, outs in _pd_runs(name, _checked(cls), ps, roles,
                                        "build_connector_meta marks those prefixes is_store=True "
                                        "on a producer."):
            _check_loads(name, role, llm, ps, outs, plain,
                         "the loaded KV went into the wrong blocks (block_ids of the metadata).")
    ran = ("a producer, a consumer and a kv_both instance" if cases != "visible"
           else "a producer and a consumer")
    n = len(prompts) if cases != "visible" else 3
    print(f"\u2713 {name}: {ran} ran through it; {n} prompts loaded what was stored and "
          "generated what a plain instance generates.")


# --------------------------------------------------------------------------- 3. the worker half
WORKER_HALF = ("start_load_kv", "save_kv_layer", "wait_for_save")
SLOT_HINT = ("position pos of a request lives in slot block_ids[pos // block_size] * block_size "
             "+ pos % block_size of the cache viewed as [2, num_blocks * block_size, "
             "num_kv_heads * head_dim]: a request's blocks need not be in order, nor next to "
             "each other.")


def _rows_problem(got: Any, kv: torch.Tensor, block_ids: list[int], n: int, bs: int,
                  stale: Optional[torch.Tensor] = None,
                  reused: Optional[torch.Tensor] = None) -> Optional[str]:
    """None when ``got`` holds the rows of positions ``[0, n)`` of the cache ``kv``; else what is
    wrong with them, and the hint for the mistake it looks like: ``stale`` is the cache before the
    step's forward wrote it, ``reused`` the cache after a later step overwrote it."""
    slots = _slots(block_ids, n, bs)
    want = _rows(kv)[:, slots]
    if not isinstance(got, torch.Tensor):
        return f"the store holds a {type(got).__name__}, not a tensor [2, {n}, H * D]."
    if got.numel() != want.numel():
        rows = got.numel() // max(1, want[0, 0].numel() * 2)
        return (f"{rows} rows stored for a prefix of {n} tokens."
                + (" hint: store only the prefix's len(token_ids) tokens: the request's last "
                   "block is partial (it holds the last prompt token, which decode recomputes)."
                   if rows > n else ""))
    got = got.reshape(want.shape).to(want.dtype).cpu()
    if torch.equal(got, want):
        return None
    if stale is not None and torch.equal(got, _rows(stale)[:, slots]):
        return ("the rows stored are what the cache held before this step's forward. hint: store a "
                "layer in its own save_kv_layer, from kv_layer: only then has the forward written "
                "that layer's K and V.")
    if reused is not None and torch.equal(got, _rows(reused)[:, slots]):
        return ("the stored rows changed when a later step reused the blocks: the store holds a "
                "view of the cache. hint: store a copy (indexing with a tensor of slots copies).")
    return f"the rows stored are not those of positions [0, {n}). hint: {SLOT_HINT}"


def _checked_worker(cls: type) -> type:
    """``cls`` with its caches filled with noise when registered, and each load compared, as it
    happens, with the store: after ``start_load_kv``, positions ``[0, n)`` of every loaded
    request hold the first ``n`` stored rows, in every layer (then ``loaded_tokens`` counts
    them). What a save must do exactly is left to the hidden cases; here the consumer's output
    shows whether what was stored and loaded is right."""
    name = cls.__name__

    class Checked(cls):
        def register_kv_caches(self, kv_caches):
            # The engine allocates its caches uninitialised: memory freed by an earlier instance
            # may still hold the very KV this one is about to compute. Noise instead, so that
            # rows stored before the forward wrote them are wrong, whatever ran before.
            gen = torch.Generator().manual_seed(0)
            for kv in kv_caches.values():
                kv.copy_(torch.randn(kv.shape, generator=gen, dtype=kv.dtype))
            super().register_kv_caches(kv_caches)

        def start_load_kv(self, forward_context, **kwargs):
            super().start_load_kv(forward_context, **kwargs)
            for req in self._get_connector_metadata().requests:
                if req.is_store:
                    continue
                n = len(req.token_ids)
                for layer, kv in self.kv_caches.items():
                    got = _rows(kv)[:, _slots(req.block_ids, n, self.block_size)]
                    stored = STORE[tuple(req.token_ids)].get(layer)
                    if not isinstance(stored, torch.Tensor) or stored.numel() % (2 * got.shape[-1]):
                        raise ExerciseCheckError(
                            f"{name}: the store's rows for {layer} are not a tensor [2, n, "
                            "num_kv_heads * head_dim].")
                    want = stored.reshape(2, -1, got.shape[-1])[:, :n].to(got.dtype)
                    if want.shape != got.shape or not torch.equal(got, want):
                        raise ExerciseCheckError(
                            f"{name}.start_load_kv: after it, request {req.req_id}'s positions "
                            f"[0, {n}) in {layer} (blocks {req.block_ids}) do not hold the "
                            f"stored rows. hint: load every layer in start_load_kv; {SLOT_HINT}")
                self.loaded_tokens[req.req_id] = n
    return Checked


_NOT_DEFERRED = ("{name}.save_kv_layer({layer!r}) put a prefix into the store itself. hint: gather "
                 "each layer's rows in save_kv_layer, and publish them in wait_for_save, once "
                 "every layer is saved (the article: 'On exit: kv_connector.wait_for_save ... "
                 "blocks until KV is uploaded'): a consumer looking the prefix up meanwhile would "
                 "find it with some layers missing.")


def _expect_stored(name: str, case: str, kv_caches: dict[str, torch.Tensor], req: Any, bs: int,
                   stale: Optional[dict[str, torch.Tensor]] = None,
                   reused: Optional[dict[str, torch.Tensor]] = None) -> None:
    """After ``wait_for_save``: the store holds, for every layer, the rows of ``req``'s stored
    prefix in ``kv_caches``."""
    entry = STORE.get(tuple(req.token_ids))
    if not isinstance(entry, dict):
        raise ExerciseCheckError(
            f"{name}, case '{case}': after wait_for_save the store has no entry for request "
            f"{req.req_id}'s {len(req.token_ids)}-token prefix (key: the tuple of its token ids; "
            f"value: {{layer name: rows}}). hint: wait_for_save publishes what save_kv_layer "
            "gathered.")
    for layer, kv in kv_caches.items():
        if layer not in entry:
            raise ExerciseCheckError(f"{name}, case '{case}': the stored prefix of request "
                                     f"{req.req_id} has no rows for {layer}: every layer is "
                                     "stored.")
        problem = _rows_problem(entry[layer], kv, req.block_ids, len(req.token_ids), bs,
                                None if stale is None else stale[layer],
                                None if reused is None else reused[layer])
        if problem:
            raise ExerciseCheckError(f"{name}, case '{case}': request {req.req_id}, prefix of "
                                     f"{len(req.token_ids)} tokens in blocks {req.block_ids} "
                                     f"(block_size {bs}), {layer}: {problem}")


LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def _worker(cls: type, bs: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """A worker-role instance of ``cls`` (``kv_both``) over two layers of 8 blocks, each slot's row
    filled with a value of its own (a previous request's KV)."""
    from minivllm.config import KVTransferConfig
    config = SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_connector="exercise",
                                                                 kv_role="kv_both"),
                             cache_config=SimpleNamespace(block_size=bs))
    conn = cls(config, KVConnectorRole.WORKER)
    caches = {layer: -(torch.arange(2 * 8 * bs * 2 * 3, dtype=torch.float32) + 1000 * i)
              .view(2, 8, bs, 2, 3) for i, layer in enumerate(LAYERS)}
    conn.register_kv_caches(caches)
    return conn, caches


def _step(conn: Any, meta: InMemoryConnectorMetadata, forward: Callable[[str], None]) -> None:
    """One step as the model runner drives it: bind, start_load_kv, per layer (the forward writes
    its K/V, then save_kv_layer), wait_for_save, clear."""
    before = set(STORE)
    conn.bind_connector_metadata(meta)
    try:
        conn.start_load_kv(None)
        for layer in LAYERS:
            forward(layer)
            conn.save_kv_layer(layer, conn.kv_caches[layer], None)
            if set(STORE) != before:
                raise ExerciseCheckError(_NOT_DEFERRED.format(name=type(conn).__name__,
                                                              layer=layer))
        conn.wait_for_save()
    finally:
        conn.clear_connector_metadata()


WORKER_HIDDEN_CASES = (
    "store a 10-token prompt's 8-token prefix from blocks [5, 2, 7]",
    "the stored rows, once a later step reused blocks [5, 2, 7]",
    "load an 8-token prefix into blocks [6, 1, 3] (the third holds the last tokens)",
)


def _worker_hidden(name: str, cls: type) -> None:
    """``WORKER_HIDDEN_CASES``: hand-made steps, blocks out of order, each prompt's last block
    partial: a store, then a load."""
    bs = 4
    # Store: a 10-token prompt in blocks [5, 2, 7]; its stored prefix is 8 tokens (blocks 5, 2).
    conn, caches = _worker(cls, bs)
    stale = {layer: kv.clone() for layer, kv in caches.items()}
    req = InMemoryReqMeta("store-0", list(range(100, 108)), [5, 2, 7], is_store=True)
    meta = InMemoryConnectorMetadata([req])

    def forward(layer: str) -> None:      # this step's K/V: every slot a new value
        caches[layer].copy_(torch.rand(caches[layer].shape, generator=gen))
    gen = torch.Generator().manual_seed(0)
    STORE.clear()
    try:
        _guard(name, lambda: _step(conn, meta, forward))
        _expect_stored(name, WORKER_HIDDEN_CASES[0], caches, req, bs, stale=stale)
        written = {layer: kv.clone() for layer, kv in caches.items()}
        for kv in caches.values():         # the next step overwrites the blocks
            kv.fill_(0.5)
        _expect_stored(name, WORKER_HIDDEN_CASES[1], written, req, bs, reused=caches)
        # Load: the same prefix into another request's blocks [6, 1, 3].
        conn, caches = _worker(cls, bs)
        before = {layer: kv.clone() for layer, kv in caches.items()}
        load = InMemoryReqMeta("load-0", list(range(100, 108)), [6, 1, 3], is_store=False)
        stored = {layer: _rows(kv)[:, _slots(req.block_ids, 8, bs)]
                  for layer, kv in written.items()}
        STORE.clear()
        STORE[tuple(load.token_ids)] = stored
        _guard(name, lambda: _step(conn, InMemoryConnectorMetadata([load]), lambda layer: None))
        case = WORKER_HIDDEN_CASES[2]
        slots = _slots(load.block_ids, 8, bs)
        for layer, kv in caches.items():
            want = _rows(before[layer]).clone()
            want[:, slots] = stored[layer].reshape(2, 8, -1)
            if not torch.equal(_rows(kv), want):
                wrong = sorted({int(s) for s in torch.nonzero((_rows(kv) != want).any(-1).any(0))})
                raise ExerciseCheckError(
                    f"{name}, case '{case}', {layer}: slots {wrong} are wrong after "
                    f"start_load_kv (the prefix's slots are {slots.tolist()}; no other slot may "
                    f"change). hint: {SLOT_HINT}")
        if set(STORE) != {tuple(load.token_ids)}:
            raise ExerciseCheckError(f"{name}, case '{case}': a load stored something: only "
                                     "requests marked is_store=True are saved.")
    finally:
        STORE.clear()


def _guard(name: str, step: Callable[[], None]) -> None:
    try:
        step()
    except NotImplementedError:
        raise ExerciseCheckError(f"{name} is not written yet: replace `raise NotImplementedError` "
                                 "with your code, run its cell, then this check again.") from None
    except ExerciseCheckError:
        raise
    except Exception as e:    # the student's bug, reported with the step that triggered it
        raise ExerciseCheckError(f"{name} raised {type(e).__name__}: {e}") from e


@exercise(name="MyWorkerConnector", assignment="pd",
          article_step="Disaggregated P/D: context manager (start_load_kv on enter, "
                       "save_kv_layer layer by layer, wait_for_save on exit)",
          forbidden=tuple(f"minivllm.learn.exercises.pd:InMemoryConnector.{m}"
                          for m in ("_slots",) + WORKER_HALF)
          + tuple(f"minivllm.distributed.kv_transfer.shared_storage_connector:"
                  f"SharedStorageConnector.{m}" for m in WORKER_HALF + ("_load_layer",))
          + ("minivllm.learn.exercises.pd:_slots",),
          mistakes=("wrong slots: the request's blocks taken as contiguous (block_ids[0] * "
                    "block_size + pos) or the position used as the slot, instead of "
                    "block_ids[pos // block_size] * block_size + pos % block_size",
                    "rows stored before the layer's K/V is written (gathered in start_load_kv, "
                    "before the forward)",
                    "the store written in save_kv_layer, not deferred to wait_for_save",
                    "the last, partial block saved (every block the request holds)"))
def check_MyWorkerConnector(cls: type, cases: str = "all") -> None:
    """Visible: a producer then a consumer ``LLM`` through ``cls`` (with the given scheduler half)
    on three prompts: the producer must store every prompt's stored prefix, the consumer must
    write the stored rows into its own blocks (as many tokens as exercise 1's plan loads) and
    generate what a plain instance generates. Hidden: ``WORKER_HIDDEN_CASES``, hand-made steps
    whose blocks are out of order, checked row by row."""
    name = getattr(cls, "__name__", "MyWorkerConnector")
    _not_written(name, cls, InMemorySchedulerConnector, WORKER_HALF)
    if cases in ("visible", "all"):
        prompts = _prompts()[:3]
        plain = _plain(prompts)
        for role, llm, outs in _pd_runs(name, _checked_worker(cls), prompts, ("kv_consumer",),
                                        "wait_for_save publishes what save_kv_layer gathered."):
            _check_loads(name, role, llm, prompts, outs, plain,
                         "the KV loaded is not the KV the producer computed. hint: store a layer "
                         "in its own save_kv_layer, from kv_layer (the forward has written that "
                         "layer's K and V then), at the slots slot_mapping gives.")
    if cases in ("hidden", "all"):
        _worker_hidden(name, cls)
    print(f"\u2713 {name}: "
          + ("a producer and a consumer ran through it, the consumer loaded what was stored and "
             "generated what a plain instance generates" if cases != "hidden" else "")
          + ("; " if cases == "all" else "")
          + (f"{len(WORKER_HIDDEN_CASES)} hand-made steps with blocks out of order pass"
             if cases != "visible" else "")
          + ".")
