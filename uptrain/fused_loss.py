"""The output projection and the loss in one chunked pass, never holding ``[tokens, vocab]`` logits.

A causal LM's last linear layer maps ``[tokens, hidden]`` to ``[tokens, vocab]`` logits: for a 1.1B
Llama at 4 x 2048 tokens that is 8,192 x 32,000 floats (1 GiB in float32, plus the same again for their
gradient and the softmax), written and read several times per step. :func:`fused_linear_loss` instead
walks the tokens in chunks: for each chunk it forms the logits, the loss and the loss's gradient with
respect to those logits, and immediately turns that into the gradients of the hidden states and of the
projection's weight and bias; the chunk's logits are then dropped. Backward only scales the stored
gradients. This is the technique of fused linear cross-entropy kernels (e.g. Liger-Kernel's), written
with plain torch operations so it runs, and is tested against the unfused objectives, on any device.

The losses are exactly those of :mod:`gqakit.uptrain.objectives`: ``lm`` is the mean next-token
cross-entropy over positions with a target (the last position has none), ``distill`` is the mean over
all positions of KL(teacher || student) at temperature ``T``, times ``T**2``, and ``mix`` is
``(1 - w) * lm + w * distill``. For distillation the teacher's logits are formed chunk by chunk as well,
from its last hidden states and output projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Elements of one chunk's float32 logits: 2**25 is 128 MiB, about 1,000 tokens of a 32k vocabulary.
CHUNK_ELEMENTS = 2**25


@dataclass(frozen=True)
class LossSpec:
    """Which loss :func:`fused_linear_loss` computes, and how.

    Attributes:
        kind: ``lm``, ``distill`` or ``mix``.
        temperature: the distillation softmax temperature.
        distill_weight: ``w`` of ``mix``.
        compute_dtype: dtype of the chunk matrix products (bfloat16 under bf16 autocast); softmaxes,
            losses and the weight gradient's accumulation are float32 whatever it is.
        chunk_elements: logits per chunk (tokens per chunk = this // vocabulary size).
    """

    kind: str = "lm"
    temperature: float = 1.0
    distill_weight: float = 0.5
    compute_dtype: torch.dtype | None = None
    chunk_elements: int = CHUNK_ELEMENTS

    @property
    def weights(self) -> tuple[float, float]:
        """The factors of the lm and distillation terms in the loss."""
        return {
            "lm": (1.0, 0.0),
            "distill": (0.0, 1.0),
            "mix": (1 - self.distill_weight, self.distill_weight),
        }[self.kind]


def _logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    z = h.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        z = z + bias.to(dtype)
    return z.float()


class _FusedLinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, teacher_hidden, teacher_weight, teacher_bias, spec):
        w_lm, w_kl = spec.weights
        dtype = spec.compute_dtype or weight.dtype
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        n_targets = (targets != -100).sum().clamp(min=1).float()
        t = spec.temperature
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        grad_b = (
            torch.zeros(vocab, dtype=torch.float32, device=weight.device)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        lm_sum = hidden.new_zeros((), dtype=torch.float32)
        kl_sum = hidden.new_zeros((), dtype=torch.float32)
        step = max(1, spec.chunk_elements // vocab)
        w_c = weight.to(dtype)
        for s in range(0, n_tokens, step):
            h = hidden[s : s + step].to(dtype)
            z = _logits(h, w_c, bias, dtype)
            dz = torch.zeros_like(z)
            if w_lm:
                y = targets[s : s + step]
                valid = y != -100
                lse = torch.logsumexp(z, dim=-1)
                picked = z.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
                lm_sum += ((lse - picked) * valid).sum()
                p = torch.exp(z - lse[:, None])
                p[valid, y[valid]] -= 1.0
                dz += p * (valid[:, None] * (w_lm / n_targets))
            if w_kl:
                zt = _logits(teacher_hidden[s : s + step], teacher_weight, teacher_bias, dtype)
                log_s = F.log_softmax(z / t, dim=-1)
                log_t = F.log_softmax(zt / t, dim=-1)
                p_t = log_t.exp()
                kl_sum += (p_t * (log_t - log_s)).sum()
                # d/dz of T**2 * mean KL(t || s(z / T)) = T * (softmax(z / T) - p_t) / n_tokens
                dz += (log_s.exp() - p_t) * (w_kl * t / n_tokens)
            dz_c = dz.to(dtype)
            if grad_h is not None:
                grad_h[s : s + step] = (dz_c @ w_c).to(hidden.dtype)
            if grad_w is not None:
                grad_w += (dz_c.t() @ h).float()
            if grad_b is not None:
                grad_b += dz.sum(0)
        lm = lm_sum / n_targets
        kl = kl_sum * t**2 / n_tokens
        loss = w_lm * lm + w_kl * kl
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(lm, kl)
        return loss, lm, kl

    @staticmethod
    def backward(ctx, grad_loss, _grad_lm, _grad_kl):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = grad_loss
        out_h = grad_h * scale.to(grad_h.dtype) if grad_h is not None else None
        out_w = (grad_w * scale).to(ctx.weight_dtype) if grad_w is not None else None
        out_b = (grad_b * scale).to(ctx.weight_dtype) if grad_b is not None else None
        return out_h, out_w, out_b, None, None, None, None, None


def fused_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input_ids: torch.Tensor,
    spec: LossSpec,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The objective of ``hidden @ weight.T + bias`` without materialising those logits.

    Args:
        hidden: the model's last hidden states, ``[batch, seq, hidden]``.
        weight: the output projection, ``[vocab, hidden]``; bias: ``[vocab]`` or None.
        input_ids: ``[batch, seq]``; position ``t`` predicts token ``t + 1`` (packed blocks, no padding).
        spec: the loss (kind, temperature, mix weight, compute dtype, chunk size).
        teacher_hidden, teacher_weight, teacher_bias: the teacher's last hidden states and output
            projection, for ``distill`` and ``mix`` (no gradient flows into them).

    Returns:
        The loss to back-propagate and its parts (``lm`` and/or ``kl``, detached), as
        :class:`~gqakit.uptrain.objectives.Objective` returns them.
    """
    if spec.kind not in ("lm", "distill", "mix"):
        raise ValueError(f"unknown objective {spec.kind!r}; choose lm, distill or mix")
    if spec.kind != "lm" and (teacher_hidden is None or teacher_weight is None):
        raise ValueError(f"objective {spec.kind!r} needs the teacher's hidden states and output projection")
    if teacher_weight is not None and teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(
            f"student vocabulary {weight.shape[0]} and teacher vocabulary {teacher_weight.shape[0]} differ: "
            "the two models need the same vocabulary."
        )
    targets = F.pad(input_ids[:, 1:], (0, 1), value=-100).flatten()
    th = None if teacher_hidden is None else teacher_hidden.flatten(0, 1).detach()
    tw = None if teacher_weight is None else teacher_weight.detach()
    tb = None if teacher_bias is None else teacher_bias.detach()
    with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen by spec.compute_dtype
        loss, lm, kl = _FusedLinearLoss.apply(hidden.flatten(0, 1), weight, bias, targets, th, tw, tb, spec)
    parts = {"lm": {"lm": lm}, "distill": {"kl": kl}, "mix": {"lm": lm, "kl": kl}}[spec.kind]
    return loss, parts


__all__ = ["CHUNK_ELEMENTS", "LossSpec", "fused_linear_loss"]
