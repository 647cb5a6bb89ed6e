"""Self-distillation data: instructions answered greedily by the target through minivllm itself,
then the target's hidden states over prompt + answer, cached so that all three methods share them.

Offline, nothing downloaded: ``prompts.json`` (in this package) holds hand-written instructions plus
templates x topics. The target answers them with ``LLM.generate`` (greedy, batched), so the training
labels are exactly what minivllm serves at temperature 0, and the hidden states are recorded
from that same run (``StateRecorder``): the numbers the engine computes. A fixed tenth of the prompts
(every 10th) is held out for evaluation.

Cache: ``$MINIVLLM_CACHE_DIR/train/<model>-<hash>.pt`` (default ``~/.cache/minivllm``), the hash
covering the checkpoint's config, the prompt texts, ``max_tokens`` and the data format version.

No vLLM file mirrors it (vLLM serves heads trained elsewhere) and no article step uses it: it is the
data of ``python -m minivllm.train``.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from importlib import resources

import torch

from minivllm.model_executor.model_loader import resolve_model_path
from minivllm.model_executor.models.llama import valid_eagle3_aux_layers
from minivllm.utils import cache_dir

DATA_VERSION = 2
HELD_OUT_EVERY = 10


@dataclass
class Sample:
    """One prompt + greedy answer. ``hidden`` ``[T, H]`` and ``aux`` ``[T, 3H]`` in float16."""
    token_ids: torch.Tensor      # [T] int64, prompt then answer
    prompt_len: int
    hidden: torch.Tensor
    aux: torch.Tensor


@dataclass
class DistillData:
    train: list[Sample]
    held_out: list[Sample]
    info: dict = field(default_factory=dict)

    @property
    def num_train_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.train)

    def answer_token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id appears in the training answers ``[vocab_size]``."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for s in self.train:
            counts += torch.bincount(s.token_ids[s.prompt_len:], minlength=vocab_size)
        return counts


def instructions(num_prompts: int | None = None) -> list[str]:
    """The first ``num_prompts`` (default all) of: hand-written instructions, then templates x
    topics, then a second set of templates x topics (each set shuffled with a fixed seed so that any
    prefix mixes kinds)."""
    spec = json.loads(resources.files("minivllm.train").joinpath("prompts.json").read_text())
    templated = [t.format(t=topic) for topic in spec["topics"] for t in spec["templates"]]
    random.Random(0).shuffle(templated)
    # The second set comes after the first: the first 400 (the 20-minute recipe's) stay put.
    more = ([t.format(t=topic) for topic in spec["more_topics"]
             for t in spec["templates"] + spec["more_templates"]]
            + [t.format(t=topic) for topic in spec["topics"] for t in spec["more_templates"]])
    random.Random(1).shuffle(more)
    texts = spec["instructions"] + templated + more
    if num_prompts is None:
        return texts
    if not 1 <= num_prompts <= len(texts):
        raise ValueError(f"num_prompts must be in [1, {len(texts)}], got {num_prompts}.")
    return texts[:num_prompts]


def _random_prompts(num_prompts: int, vocab_size: int) -> list[list[int]]:
    """Token-id prompts for a checkpoint without a tokenizer (the tiny test models)."""
    rng = random.Random(0)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(6, 20))]
            for _ in range(num_prompts)]


def _cache_path(path: str, prompts: list, max_tokens: int) -> str:
    with open(os.path.join(path, "config.json")) as f:
        config = f.read()
    key = json.dumps([DATA_VERSION, config, prompts, max_tokens]).encode()
    name = f"{os.path.basename(path.rstrip('/'))}-{hashlib.sha256(key).hexdigest()[:12]}.pt"
    return os.path.join(cache_dir(), "train", name)


def load_or_build(model: str, num_prompts: int, max_tokens: int,
                  use_cache: bool = True) -> DistillData:
    """Greedy answers + hidden states for ``num_prompts`` prompts, from the cache when present."""
    if max_tokens < 4:
        raise ValueError(f"max_tokens must be >= 4, got {max_tokens}.")
    path = resolve_model_path(model)
    has_tokenizer = any(os.path.isfile(os.path.join(path, f))
                        for f in ("tokenizer.json", "tokenizer_config.json"))
    if has_tokenizer:
        prompts: list = instructions(num_prompts)
    else:
        with open(os.path.join(path, "config.json")) as f:
            prompts = _random_prompts(num_prompts, json.load(f)["vocab_size"])
    cache = _cache_path(path, prompts, max_tokens)
    if not use_cache:
        return _build(path, prompts, max_tokens, has_tokenizer)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    # Several trainings started side by side build the data once: the first holds the lock.
    with open(cache + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(cache):
            blob = torch.load(cache, weights_only=False)
            return DistillData(blob["train"], blob["held_out"], blob["info"])
        data = _build(path, prompts, max_tokens, has_tokenizer)
        tmp = f"{cache}.{os.getpid()}.tmp"
        torch.save({"train": data.train, "held_out": data.held_out, "info": data.info}, tmp)
        os.replace(tmp, cache)   # atomic: a reader never sees half a file
    return data


class StateRecorder:
    """Records the served target's hidden states at every position the engine runs, per request.

    A forward hook on the model minivllm serves (``model_runner.model``): each forward's rows are
    split by the attention metadata's ``query_start_loc`` into the persistent batch's requests
    (row order = ``input_batch.req_ids``) and written at their ``positions``. With ``want_aux``
    the model also returns EAGLE-3's residual streams (vLLM's ``use_aux_hidden_state_outputs``), so
    one ``LLM.generate`` yields the answers and every state training needs: no second pass. The last
    sampled token of a request is never fed, so its state does not exist (the sample stops before).
    """

    def __init__(self, llm, want_aux: bool) -> None:
        self.runner = llm.llm_engine.engine_core.worker.model_runner
        model = self.runner.model
        layers = model.get_eagle3_aux_hidden_state_layers() if want_aux else ()
        # A target too shallow for 3 distinct taps (2, L//2, L-3) cannot serve EAGLE-3: no aux.
        if valid_eagle3_aux_layers(layers, model.config.num_hidden_layers):
            model.set_aux_hidden_state_layers(layers)
            self.runner.use_aux_hidden_state_outputs = True
        self.hidden: dict[str, torch.Tensor] = {}    # req_id -> [prompt + max_tokens, H] float16
        self.aux: dict[str, torch.Tensor] = {}       # req_id -> [prompt + max_tokens, 3H] float16
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        from minivllm.forward_context import get_forward_context
        hidden, aux = output if isinstance(output, tuple) else (output, None)
        positions = args[1]
        qsl = get_forward_context().attn_metadata.query_start_loc.tolist()
        aux = torch.cat(aux, dim=-1) if aux else None
        for i, req_id in enumerate(self.runner.input_batch.req_ids):
            rows = slice(qsl[i], qsl[i + 1])
            if req_id not in self.hidden:   # room for prompt + max_tokens, not max_model_len
                state = self.runner.requests[req_id]
                n = min(self.runner.max_model_len,
                        len(state.prompt_token_ids) + (state.sampling_params.max_tokens or 0))
                h = hidden.shape[-1]
                self.hidden[req_id] = torch.zeros(n, h, dtype=torch.float16)
                self.aux[req_id] = torch.zeros(n, 0 if aux is None else aux.shape[-1],
                                               dtype=torch.float16)
            pos = positions[rows]
            self.hidden[req_id][pos] = hidden[rows].half()
            if aux is not None:
                self.aux[req_id][pos] = aux[rows].half()

    def close(self) -> None:
        self._handle.remove()


def _build(path: str, prompts: list, max_tokens: int, has_tokenizer: bool) -> DistillData:
    import time

    from minivllm import LLM, SamplingParams
    t0 = time.perf_counter()
    if has_tokenizer:
        from minivllm.model_executor.model_loader import load_tokenizer
        tok = load_tokenizer(path)
        prompt_ids = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                              add_generation_prompt=True) for p in prompts]
        prompt_ids = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p)
                      for p in prompt_ids]
    else:
        prompt_ids = [list(p) for p in prompts]
    # One wave: every prompt decodes in the same batch (wider batches use the CPU better).
    llm = LLM(model=path, seed=0, dtype="float32", skip_tokenizer_init=not has_tokenizer,
              enable_prefix_caching=False, max_num_seqs=min(256, len(prompt_ids)),
              kv_cache_memory_bytes=3 << 30)
    recorder = StateRecorder(llm, want_aux=True)
    # One token more than the answer length: the last sampled token is never fed, so the answer
    # keeps max_tokens tokens that all have states.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens + 1), use_tqdm=True)
    recorder.close()
    samples = []
    for p, o in zip(prompt_ids, outs):
        ids = p + list(o.outputs[0].token_ids)[:-1]     # every token here was fed to the target
        n = len(ids)
        samples.append(Sample(torch.tensor(ids), len(p), recorder.hidden[o.request_id][:n].clone(),
                              recorder.aux[o.request_id][:n].clone()))
    del llm, recorder
    held = [s for i, s in enumerate(samples) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [s for i, s in enumerate(samples) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    answers = [len(s.token_ids) - s.prompt_len for s in samples]
    info = dict(num_prompts=len(prompts), max_tokens=max_tokens, answer_tokens=sum(answers),
                total_tokens=sum(len(s.token_ids) for s in samples),
                data_s=round(time.perf_counter() - t0, 1))
    return DistillData(train, held, info)
