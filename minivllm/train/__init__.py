"""Training EAGLE, EAGLE-3 and Medusa heads for a target model by self-distillation, on the CPU.

``python -m minivllm.train {eagle,eagle3,medusa} [--quick] [--out DIR] [--seed S]``, or from Python::

    from minivllm.train import TrainConfig, train
    result = train(TrainConfig(method="medusa", quick=True, out="heads/medusa"))
    result.eval["per_pos"]    # held-out per-position acceptance, computed densely

Pieces: ``data`` (instructions answered greedily by the target through ``LLM.generate``, then its
hidden states), ``dense`` (the target's layers run without paging), ``heads`` (dense draft modules
named as vLLM's checkpoints), ``losses`` (Medusa-1, EAGLE-1, EAGLE-3 as published), ``loop`` (the
optimiser loop and the held-out evaluation), ``export`` (the vLLM-format directory).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

from minivllm.model_executor.model_loader import DEFAULT_MODEL, load_model, resolve_model_path
from minivllm.train.data import DistillData, load_or_build
from minivllm.train.export import save_head
from minivllm.train.heads import DraftConfig, EagleDraft, MedusaHeads
from minivllm.train.loop import Trainer, evaluate, run_training

METHODS = ("eagle", "eagle3", "medusa")
# (full, quick) defaults. The full ones are the shipped heads' recipe: about 43 minutes on two quiet
# CPU cores, data included (README); ``--num-prompts 400 --epochs 8`` is the 20-minute recipe, whose
# heads accept less (the heads are data-bound).
DEFAULTS = {
    "num_prompts": (1600, 32), "max_tokens": (128, 48), "batch_size": (4, 8),
    "epochs": {"medusa": (4, 8), "eagle": (4, 4), "eagle3": (4, 3)},
    "lr": {"medusa": (1e-3, 2e-3), "eagle": (1e-3, 2e-3), "eagle3": (1e-3, 2e-3)},
    "draft_vocab_size": {"medusa": (1024, 1024), "eagle": (2048, 1024), "eagle3": (2048, 1024)},
}
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "spec_decode", "heads", "smollm2-135m-instruct")


@dataclass
class TrainConfig:
    """What to train. ``None`` fields take the full or ``quick`` default from ``DEFAULTS``."""
    method: str
    model: str = DEFAULT_MODEL
    quick: bool = False
    out: Optional[str] = None
    seed: int = 0
    k: int = 3                     # Medusa heads / EAGLE-3 unrolled steps / evaluated depth
    num_prompts: Optional[int] = None
    max_tokens: Optional[int] = None
    epochs: Optional[int] = None
    lr: Optional[float] = None
    batch_size: Optional[int] = None
    draft_vocab_size: Optional[int] = None   # EAGLE-3 d2t / Medusa token_map size (EAGLE: loss only)
    intermediate_size: Optional[int] = None  # EAGLE MLP width; default the target's // 3
    num_layers: int = 1            # Medusa residual blocks per head
    noise: float = 0.2             # EAGLE-1 uniform feature noise width
    # EAGLE-3's token loss: "soft" (the target's distribution over the draft vocab, as published) or
    # "hard" (the greedy token: what acceptance at temperature 0 checks; measured better here).
    labels: str = "hard"
    threads: Optional[int] = None
    dtype: str = "float16"
    use_cache: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}.")
        if not 1 <= self.k <= 10:
            raise ValueError(f"k must be in [1, 10], got {self.k}.")
        for name in ("num_prompts", "max_tokens", "epochs", "batch_size", "draft_vocab_size",
                     "intermediate_size", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}.")
        if self.labels not in ("soft", "hard"):
            raise ValueError(f"labels must be 'soft' or 'hard', got {self.labels!r}.")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}.")
        if self.dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"dtype must be float16, bfloat16 or float32, got {self.dtype!r}.")
        q = int(self.quick)
        for name in ("num_prompts", "max_tokens", "batch_size"):
            if getattr(self, name) is None:
                setattr(self, name, DEFAULTS[name][q])
        for name in ("epochs", "lr", "draft_vocab_size"):
            if getattr(self, name) is None:
                setattr(self, name, DEFAULTS[name][self.method][q])


@dataclass
class TrainResult:
    config: TrainConfig
    head: torch.nn.Module
    eval: dict
    info: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)


def build_head(cfg: TrainConfig, target, vocab_ids: torch.Tensor) -> torch.nn.Module:
    """A fresh head for ``target``; lm_heads start from the target's rows (as Medusa does)."""
    tc = target.config
    lm_rows = target.lm_head.weight.detach()[vocab_ids].clone()
    if cfg.method == "medusa":
        head = MedusaHeads(tc.hidden_size, cfg.k, cfg.num_layers, vocab_ids)
        for lm in head.lm_heads:
            lm.weight.data.copy_(lm_rows)
        return head
    from minivllm.model_executor.models.llama import rope_config
    attn = target.model.layers[0].self_attn
    theta, rope = rope_config(tc)
    dcfg = DraftConfig(tc.hidden_size, cfg.intermediate_size or tc.intermediate_size // 3,
                       attn.num_heads, attn.num_kv_heads, attn.head_dim, tc.rms_norm_eps, theta,
                       rope, tc.vocab_size, len(vocab_ids))
    head = EagleDraft(dcfg, cfg.method)
    if cfg.method == "eagle3":
        head.lm_head.weight.data.copy_(lm_rows)
        head.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids)))   # target = draft + d2t[draft]
    return head


def train(cfg: TrainConfig, data: Optional[DistillData] = None) -> TrainResult:
    """Build (or reuse) the data, train, evaluate on held-out prompts, write ``cfg.out``."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    if data is None:
        data = load_or_build(cfg.model, cfg.num_prompts, cfg.max_tokens, cfg.use_cache)
    t_data = time.perf_counter() - t0
    if cfg.method == "eagle3" and data.train[0].aux.shape[-1] == 0:
        raise ValueError(f"model={cfg.model!r}: EAGLE-3 needs 3 distinct target layers "
                         "(2, L//2, L-3); this target is too shallow.")
    path = resolve_model_path(cfg.model)
    target = load_model(path, torch.float32, torch.device("cpu"))
    embed = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach()
    counts = data.answer_token_counts(embed.shape[0])
    size = min(cfg.draft_vocab_size, embed.shape[0])
    # The most frequent answer tokens (ties broken by id), kept in id order as vLLM's d2t expects.
    vocab_ids = torch.sort(torch.argsort(-counts, stable=True)[:size]).values
    torch.manual_seed(cfg.seed)
    head = build_head(cfg, target, vocab_ids)
    gen = torch.Generator().manual_seed(cfg.seed)
    trainer = Trainer(cfg.method, head, embed, lm_head, vocab_ids, cfg.k, cfg.noise, gen,
                      cfg.labels == "soft")
    t1 = time.perf_counter()
    losses = run_training(trainer, data.train, cfg.epochs, cfg.batch_size, cfg.lr, gen,
                          desc=f"train {cfg.method}")
    t_train = time.perf_counter() - t1
    head.eval()
    result_eval = evaluate(cfg.method, head, embed, lm_head, data.held_out, cfg.k)
    covered = float(counts[vocab_ids].sum() / counts.sum().clamp(min=1))
    info = dict(method=cfg.method, target=cfg.model, config={k: v for k, v in asdict(cfg).items()
                                                              if k not in ("out", "use_cache")},
                command=" ".join(["python -m minivllm.train"] + sys.argv[1:])
                if sys.argv and sys.argv[0].endswith("__main__.py") else None,
                data=dict(data.info, train_prompts=len(data.train), held_out_prompts=len(data.held_out),
                          train_tokens=data.num_train_tokens),
                draft_vocab_size=size, draft_vocab_coverage_of_answers=round(covered, 4),
                steps=len(losses), final_loss=round(losses[-1], 4) if losses else None,
                trainable_params=sum(p.numel() for p in head.parameters()),
                data_s=round(t_data, 1), train_s=round(t_train, 1),
                threads=torch.get_num_threads(), held_out=result_eval)
    if cfg.out:
        save_head(cfg.out, cfg.method, head, target.config, info, cfg.dtype)
    return TrainResult(cfg, head, result_eval, info, losses)
