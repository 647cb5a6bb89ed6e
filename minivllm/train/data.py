"""Self-distillation data: instructions answered greedily by the target through minivllm itself,
then the target's hidden states over prompt + answer, cached so that all three methods share them.

Offline, nothing downloaded: ``prompts.json`` (in this package) holds hand-written instructions plus
templates x topics. The target answers them with ``LLM.generate`` (greedy, batched), so the training
labels are exactly what minivllm serves at temperature 0, and the hidden states come from
``dense.target_hidden_states`` over the same weights (``load_model``). A fixed tenth of the prompts
(every 10th) is held out for evaluation.

Cache: ``$MINIVLLM_CACHE_DIR/train/<model>-<hash>.pt`` (default ``~/.cache/minivllm``), the hash
covering the checkpoint's config, the prompt texts, ``max_tokens`` and the data format version.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from importlib import resources

import torch
from tqdm.auto import tqdm

from minivllm.model_executor.model_loader import cache_dir, load_model, resolve_model_path
from minivllm.train.dense import eagle3_aux_layers, target_hidden_states

DATA_VERSION = 1
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


def instructions(num_prompts: int) -> list[str]:
    """The first ``num_prompts`` of: hand-written instructions, then templates x topics (shuffled
    with a fixed seed so that any prefix mixes kinds)."""
    spec = json.loads(resources.files("minivllm.train").joinpath("prompts.json").read_text())
    templated = [t.format(t=topic) for topic in spec["topics"] for t in spec["templates"]]
    random.Random(0).shuffle(templated)
    texts = spec["instructions"] + templated
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
    if use_cache and os.path.isfile(cache):
        blob = torch.load(cache, weights_only=False)
        return DistillData(blob["train"], blob["held_out"], blob["info"])
    data = _build(path, prompts, max_tokens, has_tokenizer)
    if use_cache:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.tmp"
        torch.save({"train": data.train, "held_out": data.held_out, "info": data.info}, tmp)
        os.replace(tmp, cache)   # atomic: a parallel run never reads half a file
    return data


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
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=True)
    del llm
    t_gen = time.perf_counter() - t0
    seqs = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompt_ids, outs)]
    model = load_model(path, torch.float32, torch.device("cpu"))
    samples: list[Sample] = [None] * len(seqs)   # type: ignore[list-item]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) + len(seqs[i][1]))
    batch = 8
    aux_ids = eagle3_aux_layers(model.config.num_hidden_layers)
    want_aux = len(set(aux_ids)) == 3 and min(aux_ids) >= 0   # else the target can't serve EAGLE-3
    for start in tqdm(range(0, len(order), batch), desc="target hidden states", dynamic_ncols=True):
        idx = order[start:start + batch]
        ids = [torch.tensor(seqs[i][0] + seqs[i][1]) for i in idx]
        padded = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)
        hidden, aux = target_hidden_states(model, padded, want_aux)
        if aux is None:
            aux = hidden[..., :0]
        for row, i in enumerate(idx):
            n = len(ids[row])
            samples[i] = Sample(ids[row], len(seqs[i][0]), hidden[row, :n].half().clone(),
                                aux[row, :n].half().clone())
    held = [s for i, s in enumerate(samples) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [s for i, s in enumerate(samples) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    info = dict(num_prompts=len(prompts), max_tokens=max_tokens,
                answer_tokens=sum(len(a) for _, a in seqs),
                total_tokens=sum(len(p) + len(a) for p, a in seqs),
                generate_s=round(t_gen, 1), data_s=round(time.perf_counter() - t0, 1))
    return DistillData(train, held, info)
