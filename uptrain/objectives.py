"""Training objectives: next-token cross-entropy (``lm``), distillation KL at a temperature (``distill``)
and their ``mix``, from logits or fused with the output projection.

Losses are float32 and averaged over tokens. The fused loss (:func:`fused_linear_loss`) never holds the
``[tokens, vocab]`` logits (why and how: docs/uptrain.md#the-fused-loss).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _next_tokens(input_ids: torch.Tensor) -> torch.Tensor:
    """Targets aligned with the logits: position ``t`` gets token ``t + 1``; the last gets -100 (ignored).

    Shifting the targets instead of slicing the logits avoids copying the ``[batch, seq, vocab]`` logits
    (transformers' own causal-LM loss does the same).
    """
    return F.pad(input_ids[:, 1:], (0, 1), value=-100)


def lm_loss_per_sequence(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each sequence, ``[batch]``: position ``t`` predicts token ``t + 1``.

    Args:
        logits: ``[batch, seq, vocab]``.
        input_ids: ``[batch, seq]``; every block is full (packed), so there is no padding to mask.
    """
    tok = F.cross_entropy(
        logits.flatten(0, 1).float(), _next_tokens(input_ids).flatten(), ignore_index=-100, reduction="none"
    )
    return tok.view(input_ids.shape).sum(dim=1) / (input_ids.shape[1] - 1)


def distill_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) of the softened distributions, times ``T**2``.

    The ``T**2`` factor (Hinton et al., 2015) keeps gradient magnitudes comparable across temperatures.
    Exactly zero when the two logits are equal. (Preflight has checked that the two models share one
    vocabulary.)
    """
    s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    kl = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)  # [batch, seq]
    return kl.mean() * temperature**2


# Elements of one chunk's float32 logits in the fused loss: 2**25 is 128 MiB, about 1,000 tokens of a 32k
# vocabulary.
CHUNK_ELEMENTS = 2**25


@dataclass(frozen=True)
class Objective:
    """``lm``, ``distill`` or ``mix``: loss = (1 - w) * lm + w * KL, from logits (calling it) or fused
    with the output projection (:func:`fused_linear_loss`).

    Calling it returns the loss to back-propagate and its parts (detached) for logging.

    Attributes:
        kind: ``lm``, ``distill`` or ``mix``.
        temperature: the distillation softmax temperature.
        distill_weight: ``w`` of ``mix``.
        compute_dtype: the fused loss's dtype of the chunk matrix products (bfloat16 under bf16
            autocast); softmaxes, losses and the weight gradient's accumulation are float32 whatever it is.
        chunk_elements: the fused loss's logits per chunk (tokens per chunk = this // vocabulary size).
    """

    kind: str = "lm"
    temperature: float = 1.0
    distill_weight: float = 0.5
    compute_dtype: torch.dtype | None = None
    chunk_elements: int = CHUNK_ELEMENTS

    @property
    def weights(self) -> tuple[float, float]:
        """The factors of the lm and distillation terms in the loss."""
        w = self.distill_weight
        return {"lm": (1.0, 0.0), "distill": (0.0, 1.0), "mix": (1 - w, w)}[self.kind]

    def __call__(
        self, logits: torch.Tensor, input_ids: torch.Tensor, teacher_logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        parts: dict[str, torch.Tensor] = {}
        if self.kind in ("lm", "mix"):
            parts["lm"] = lm_loss_per_sequence(logits, input_ids).mean()  # every block has as many targets
        if self.kind in ("distill", "mix"):
            if teacher_logits is None:
                raise ValueError(f"objective {self.kind!r} needs the teacher's logits")
            parts["kl"] = distill_kl(logits, teacher_logits, self.temperature)
        w_lm, w_kl = self.weights
        loss = w_lm * parts["lm"] + w_kl * parts["kl"] if self.kind == "mix" else next(iter(parts.values()))
        return loss, {k: v.detach() for k, v in parts.items()}


# Config fields that transform the logits after the output projection; the fused loss would skip them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


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
        f32 = {"dtype": torch.float32, "device": weight.device}  # the weight gradients accumulate in float32
        grad_w = torch.zeros(weight.shape, **f32) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros(vocab, **f32) if bias is not None and ctx.needs_input_grad[2] else None
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
        out_h = grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None
        out_w = (grad_w * grad_loss).to(ctx.weight_dtype) if grad_w is not None else None
        out_b = (grad_b * grad_loss).to(ctx.weight_dtype) if grad_b is not None else None
        return out_h, out_w, out_b, None, None, None, None, None


def fused_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    input_ids: torch.Tensor,
    spec: Objective,
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
        :class:`Objective` returns them.
    """
    if spec.kind != "lm" and (teacher_hidden is None or teacher_weight is None):
        raise ValueError(f"objective {spec.kind!r} needs the teacher's hidden states and output projection")
    targets = _next_tokens(input_ids).flatten()
    # (no gradient flows into the teacher: backward returns None for its inputs)
    th = None if teacher_hidden is None else teacher_hidden.flatten(0, 1)
    with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen by spec.compute_dtype
        loss, lm, kl = _FusedLinearLoss.apply(
            hidden.flatten(0, 1), weight, bias, targets, th, teacher_weight, teacher_bias, spec
        )
    parts = {"lm": {"lm": lm}, "distill": {"kl": kl}, "mix": {"lm": lm, "kl": kl}}[spec.kind]
    return loss, parts


def fused_loss_unsupported(model: torch.nn.Module) -> str | None:
    """Why the fused loss cannot stand in for this model's own logits, or None when it can."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return "the model has no linear output projection"
    for name in _LOGIT_TRANSFORMS:
        value = getattr(model.config, name, None)
        if value not in (None, 1, 1.0):
            return f"{model.config.model_type} transforms its logits ({name}={value})"
    return None


def install_fused_loss(model: torch.nn.Module) -> None:
    """Give ``model`` a forward that, when called with ``loss_spec=``, returns the fused objective.

    Called without it, the forward is the model's own (logits, for evaluation). The loss is computed
    inside the model's forward so that DDP and FSDP wrappers, which act around ``forward``, see it.
    """
    own = model.forward

    def forward(self, input_ids=None, *args, loss_spec: Objective | None = None, teacher=None, **kwargs):
        if loss_spec is None:
            return own(input_ids, *args, **kwargs)
        hidden, weight, bias = hidden_and_head(self, input_ids)
        return fused_linear_loss(hidden, weight, bias, input_ids, loss_spec, *(teacher or ()))

    model.forward = types.MethodType(forward, model)


def hidden_and_head(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple:
    """The model's last hidden states and output projection (weight, bias): what the fused loss takes, of
    the student and of the teacher."""
    head = model.get_output_embeddings()
    hidden = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
    return hidden, head.weight, head.bias
