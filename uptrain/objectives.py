"""Training objectives: next-token cross-entropy, distillation KL at a temperature, and their mix.

Pure functions of logits; no model, no I/O. Losses are computed in float32 whatever the logits'
dtype, and averaged over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """Targets aligned with the logits: position ``t`` gets token ``t + 1``; the last gets -100 (ignored).

    Shifting the targets instead of slicing the logits avoids copying the ``[batch, seq, vocab]`` logits
    (transformers' own causal-LM loss does the same).
    """
    return F.pad(input_ids[:, 1:], (0, 1), value=-100)


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: position ``t`` predicts token ``t + 1``.

    Args:
        logits: ``[batch, seq, vocab]``.
        input_ids: ``[batch, seq]``; every block is full (packed), so there is no padding to mask.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), _next_tokens(input_ids).flatten(), ignore_index=-100)


def lm_loss_per_sequence(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each sequence, ``[batch]`` (for validation perplexity)."""
    tok = F.cross_entropy(
        logits.flatten(0, 1).float(), _next_tokens(input_ids).flatten(), ignore_index=-100, reduction="none"
    )
    return tok.view(input_ids.shape).sum(dim=1) / (input_ids.shape[1] - 1)


def distill_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) of the softened distributions, times ``T**2``.

    The ``T**2`` factor (Hinton et al., 2015) keeps gradient magnitudes comparable across temperatures.
    Exactly zero when the two logits are equal.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
            "differ in shape: the two models need the same vocabulary."
        )
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    kl = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)  # [batch, seq]
    return kl.mean() * temperature**2


@dataclass(frozen=True)
class Objective:
    """``lm``, ``distill`` or ``mix``: loss = (1 - w) * lm + w * KL.

    Calling it returns the loss to back-propagate and its parts (detached) for logging.
    """

    kind: str = "lm"
    temperature: float = 1.0
    distill_weight: float = 0.5

    @property
    def needs_teacher(self) -> bool:
        return self.kind in ("distill", "mix")

    def __call__(
        self, logits: torch.Tensor, input_ids: torch.Tensor, teacher_logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        parts: dict[str, torch.Tensor] = {}
        if self.kind in ("lm", "mix"):
            parts["lm"] = lm_loss(logits, input_ids)
        if self.kind in ("distill", "mix"):
            if teacher_logits is None:
                raise ValueError(f"objective {self.kind!r} needs the teacher's logits")
            parts["kl"] = distill_kl(logits, teacher_logits, self.temperature)
        if self.kind == "lm":
            loss = parts["lm"]
        elif self.kind == "distill":
            loss = parts["kl"]
        elif self.kind == "mix":
            loss = (1 - self.distill_weight) * parts["lm"] + self.distill_weight * parts["kl"]
        else:
            raise ValueError(f"unknown objective {self.kind!r}; choose lm, distill or mix")
        return loss, {k: v.detach() for k, v in parts.items()}


__all__ = ["Objective", "distill_kl", "lm_loss", "lm_loss_per_sequence"]
