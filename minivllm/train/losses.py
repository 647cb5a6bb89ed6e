"""The published training losses, on dense tensors.

- Medusa-1 (Cai et al. 2024): frozen backbone; head j (0-based) at position t predicts the token
  j+2 places ahead, ``x_{t+j+2}`` (the target itself predicts ``x_{t+1}``); cross-entropy per
  head, weighted ``0.8 ** j`` (``MEDUSA_DECAY``).
- EAGLE-1 (Li et al. 2024, ``SafeAILab/EAGLE`` ``eagle/train/main.py``): SmoothL1 between the
  draft's output and the target's next feature, plus ``0.1`` x soft cross-entropy between the
  target's distribution and the draft's (both through the target's lm_head).
- EAGLE-3 (Li et al. 2025): training-time test, the draft unrolled over its own steps; only a token
  loss, soft cross-entropy against the target's distribution, step i weighted ``0.8 ** i``. The
  trainer can also give it one-hot targets, the greedy token (``TrainConfig.labels="hard"``, the
  default): acceptance at temperature 0 checks only the argmax, and a 135M model's next-token
  distributions are flat enough that matching their tails costs the head capacity it lacks.

Every loss is a mean over the positions where ``mask`` is True (per head / step, then weighted sum).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MEDUSA_DECAY = 0.8
EAGLE3_DECAY = 0.8
EAGLE_P_WEIGHT = 0.1
IGNORE_INDEX = -100


def medusa_loss(head_logits: list[torch.Tensor], labels: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """``head_logits[j]`` ``[N, V]``, ``labels`` ``[num_heads, N]`` (``IGNORE_INDEX`` = no loss).

    Returns (sum_j 0.8^j CE_j, the per-head CE values). A head with no labelled row adds 0.
    """
    total = head_logits[0].new_zeros(())
    per_head = []
    for j, logits in enumerate(head_logits):
        if (labels[j] != IGNORE_INDEX).any():
            ce = F.cross_entropy(logits, labels[j], ignore_index=IGNORE_INDEX)
        else:
            ce = logits.sum() * 0.0
        total = total + MEDUSA_DECAY ** j * ce
        per_head.append(float(ce.detach()))
    return total, per_head


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """``-sum_v p_target(v) log p_draft(v)``, mean over rows where ``mask``; ``[N, V]``, ``[N]``."""
    per_row = -(target_probs * F.log_softmax(logits, dim=-1)).sum(-1)
    return (per_row * mask).sum() / mask.sum().clamp(min=1)


def eagle_loss(pred_feat: torch.Tensor, target_feat: torch.Tensor, pred_logits: torch.Tensor,
               target_logits: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """EAGLE-1: ``SmoothL1(pred, f_{t+1}) + 0.1 * softCE``.

    ``pred_feat``/``target_feat`` ``[N, H]``, ``pred_logits``/``target_logits`` ``[N, V]`` (the same
    lm_head applied to both), ``mask`` ``[N]`` float. The regression term is the mean SmoothL1 over
    the hidden dimension, averaged over masked rows (EAGLE's ``vloss``).
    """
    denom = mask.sum().clamp(min=1)
    v = (F.smooth_l1_loss(pred_feat, target_feat, reduction="none").mean(-1) * mask).sum() / denom
    p = soft_cross_entropy(pred_logits, target_logits.softmax(-1), mask)
    return v + EAGLE_P_WEIGHT * p, {"vloss": float(v.detach()), "ploss": float(p.detach())}


def eagle3_loss(step_logits: list[torch.Tensor], step_target_probs: list[torch.Tensor],
                step_masks: list[torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
    """EAGLE-3 training-time test: ``sum_i 0.8^i softCE_i`` over the unrolled steps ``i``.

    Each list holds one ``[N, V']`` / ``[N, V']`` / ``[N]`` entry per step.
    """
    total = step_logits[0].new_zeros(())
    per_step = []
    for i, (logits, probs, mask) in enumerate(zip(step_logits, step_target_probs, step_masks)):
        ce = soft_cross_entropy(logits, probs, mask)
        total = total + EAGLE3_DECAY ** i * ce
        per_step.append(float(ce.detach()))
    return total, per_step
