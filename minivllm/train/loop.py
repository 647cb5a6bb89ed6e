"""The training loop: mini-batches of right-padded sequences, AdamW with warm-up and cosine decay,
a tqdm bar, seeded and deterministic (same seed, same data, same thread count -> same weights).

Index conventions (t = position in prompt + answer, ``x`` the token ids, ``f_t`` the target's
final-normed hidden state at t, ``g_t`` EAGLE-3's three auxiliary states at t). After the target
processed position t it has sampled ``x_{t+1}``; the drafts then guess ``x_{t+2}, x_{t+3}, ...``:
- Medusa head j reads ``f_t`` and predicts ``x_{t+j+2}``;
- EAGLE pass 1 at position t is fed ``(x_{t+1}, f_t)`` (EAGLE-3: ``fc(g_t)``) and predicts
  ``x_{t+2}``; pass i+1 is fed pass i's token and output state at position t+i.
Losses count only answer tokens (what the target generated), as the published trainers do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from minivllm.train.data import Sample
from minivllm.train.losses import IGNORE_INDEX, eagle3_loss, eagle_loss, medusa_loss


@dataclass
class Batch:
    ids: torch.Tensor         # [B, T] int64, 0-padded
    hidden: torch.Tensor      # [B, T, H] float32
    aux: torch.Tensor         # [B, T, 3H] float32 (EAGLE-3) or empty
    lens: torch.Tensor        # [B]
    prompt_lens: torch.Tensor  # [B]

    @property
    def positions(self) -> torch.Tensor:
        b, t = self.ids.shape
        return torch.arange(t).expand(b, t)

    def window(self, start: int, end: int) -> torch.Tensor:
        """``[B, T]`` bool: positions t with ``prompt_len + start <= t`` and ``t + end < len``."""
        pos = self.positions
        return (pos >= self.prompt_lens[:, None] + start) & (pos + end < self.lens[:, None])


def collate(samples: list[Sample], need_aux: bool) -> Batch:
    pad = torch.nn.utils.rnn.pad_sequence
    return Batch(pad([s.token_ids for s in samples], batch_first=True),
                 pad([s.hidden for s in samples], batch_first=True).float(),
                 pad([s.aux for s in samples], batch_first=True).float() if need_aux
                 else torch.empty(0),
                 torch.tensor([len(s.token_ids) for s in samples]),
                 torch.tensor([s.prompt_len for s in samples]))


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]`` (zeros past the end), along dim 1."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)


def target_to_draft(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]``: draft id of each target id, ``IGNORE_INDEX`` outside the draft vocab."""
    t2d = torch.full((vocab_size,), IGNORE_INDEX, dtype=torch.int64)
    t2d[vocab_ids] = torch.arange(len(vocab_ids))
    return t2d


class Trainer:
    """Holds the frozen target pieces the losses need: ``embed`` ``[V, H]``, ``lm_head`` ``[V, H]``,
    the reduced vocabulary ``vocab_ids`` ``[V']`` (sorted target ids) and its inverse ``t2d``."""

    def __init__(self, method: str, head, embed: torch.Tensor, lm_head: torch.Tensor,
                 vocab_ids: torch.Tensor, k: int, noise: float, generator: torch.Generator,
                 soft_labels: bool = True) -> None:
        self.method, self.head, self.k, self.noise, self.gen = method, head, k, noise, generator
        self.soft_labels = soft_labels
        self.embed, self.lm_head, self.vocab_ids = embed, lm_head, vocab_ids
        self.t2d = target_to_draft(vocab_ids, embed.shape[0])
        self.lm_head_reduced = lm_head[vocab_ids]    # [V', H]

    def loss(self, b: Batch) -> tuple[torch.Tensor, dict]:
        return getattr(self, f"_loss_{self.method}")(b)

    def _loss_medusa(self, b: Batch):
        valid = b.window(-1, 0)                                   # t >= prompt_len - 1
        h = b.hidden[valid]                                       # [N, H]
        labels = torch.stack([self.t2d[shift_left(b.ids, j + 2)][valid].masked_fill(
            ~b.window(-1, j + 2)[valid], IGNORE_INDEX) for j in range(len(self.head.blocks))])
        total, per_head = medusa_loss(self.head(h), labels)
        return total, {f"ce{j}": v for j, v in enumerate(per_head)}

    def _loss_eagle(self, b: Batch):
        emb = self.embed[shift_left(b.ids, 1)]
        hid = b.hidden
        if self.noise:   # EAGLE's feature noise: the draft later reads its own imperfect features
            hid = hid + (torch.rand(hid.shape, generator=self.gen) - 0.5) * self.noise
        pred, _ = self.head.step(emb, hid, b.positions, [])
        mask = b.window(-2, 1)                                    # f_{t+1} is an answer-side state
        target = shift_left(b.hidden, 1)[mask]
        pred = pred[mask]
        total, parts = eagle_loss(pred, target, pred @ self.lm_head_reduced.T,
                                  target @ self.lm_head_reduced.T, torch.ones(len(pred)))
        return total, parts

    def _loss_eagle3(self, b: Batch):
        hid = self.head.combine_hidden_states(b.aux)
        cache: list = []
        logits, probs, masks = [], [], []
        for i in range(self.k):
            emb = self.embed[shift_left(b.ids, 1 + i)]
            normed, hid = self.head.step(emb, hid, b.positions + i, cache)
            label = self.t2d[shift_left(b.ids, 2 + i)]
            mask = b.window(-2 - i, 2 + i) & (label != IGNORE_INDEX)
            logits.append(self.head.lm_head(normed[mask]))
            if self.soft_labels:   # the target's next-token distribution, from its next feature
                target_feat = shift_left(b.hidden, 1 + i)[mask]
                probs.append((target_feat @ self.lm_head_reduced.T).softmax(-1))
            else:   # the greedy token itself: what acceptance at temperature 0 checks
                probs.append(F.one_hot(label[mask], len(self.vocab_ids)).float())
            masks.append(torch.ones(int(mask.sum())))
        total, per_step = eagle3_loss(logits, probs, masks)
        return total, {f"ce{i}": v for i, v in enumerate(per_step)}


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of ``peak``."""
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def run_training(trainer: Trainer, samples: list[Sample], epochs: int, batch_size: int,
                 lr: float, generator: torch.Generator, desc: str) -> list[float]:
    """AdamW over ``epochs`` shuffled passes; returns the loss of every step."""
    params = [p for p in trainer.head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    need_aux = trainer.method == "eagle3"
    per_epoch = math.ceil(len(samples) / batch_size)
    total = epochs * per_epoch
    losses: list[float] = []
    bar = tqdm(total=total, desc=desc, dynamic_ncols=True)
    step = 0
    for _ in range(epochs):
        order = torch.randperm(len(samples), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            batch = collate([samples[i] for i in order[start:start + batch_size]], need_aux)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, lr)
            loss, parts = trainer.loss(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_value_(params, 0.5)   # EAGLE's clipping
            opt.step()
            losses.append(loss.item())
            step += 1
            bar.set_postfix(loss=f"{losses[-1]:.3f}", **{k: f"{v:.2f}" for k, v in parts.items()})
            bar.update(1)
    bar.close()
    return losses


@torch.no_grad()
def evaluate(method: str, head, embed: torch.Tensor, lm_head: torch.Tensor,
             samples: list[Sample], k: int) -> dict:
    """Held-out greedy drafting, dense: at every answer position t with k tokens left, draft k
    tokens the way the runtime does and compare with the target's greedy continuation.

    Returns ``per_pos`` (vLLM's per-position acceptance: drafts 0..j all match), ``top1`` (draft j
    matches, regardless of earlier ones), ``mean_acceptance_length`` = 1 + sum(per_pos) and
    ``num_positions``.
    """
    if method == "medusa" and k > len(head.blocks):
        raise ValueError(f"k ({k}) is larger than the number of Medusa heads ({len(head.blocks)}).")
    chain_hits = torch.zeros(k)
    top1_hits = torch.zeros(k)
    n = 0
    for s in samples:
        b = collate([s], method == "eagle3")
        mask = b.window(-1, k + 1)[0]                             # x_{t+1..t+k+1} all exist
        if not mask.any():
            continue
        drafts = _draft(method, head, embed, lm_head, b, k)       # [T, k] target ids
        truth = torch.stack([shift_left(b.ids, j + 2)[0] for j in range(k)], dim=-1)
        match = (drafts == truth)[mask]                           # [N, k]
        chain_hits += match.cumprod(-1).sum(0)
        top1_hits += match.sum(0)
        n += len(match)
    per_pos = (chain_hits / max(n, 1)).tolist()
    return dict(per_pos=[round(p, 4) for p in per_pos],
                top1=[round(p, 4) for p in (top1_hits / max(n, 1)).tolist()],
                mean_acceptance_length=round(1 + sum(per_pos), 4), num_positions=n)


def _draft(method: str, head, embed, lm_head, b: Batch, k: int) -> torch.Tensor:
    if method == "medusa":
        ids = torch.stack([logits.argmax(-1) for logits in head(b.hidden)], dim=-1)[0]
        return head.token_map[ids]
    hid = head.combine_hidden_states(b.aux) if method == "eagle3" else b.hidden
    tokens = shift_left(b.ids, 1)
    cache: list = []
    out = []
    for i in range(k):
        normed, hid = head.step(embed[tokens], hid, b.positions + i, cache)
        tokens = head.to_target_ids(head.draft_logits(normed, lm_head).argmax(-1))
        out.append(tokens[0])
    return torch.stack(out, dim=-1)
