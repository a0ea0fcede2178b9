"""Layer-wise refinement: fit each converted attention block to the original's output on calibration text.

A merge cannot see the softmax; refinement runs a few Adam steps per layer from the merge, no gradient
crossing layers (docs/convert.md, "Layer-wise refinement"). Two targets are kept (:data:`REFINE_TARGETS`),
each with the loss measured better with it; docs/convert.md compares the variants measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gqakit.convert.calibrate import batches
from gqakit.errors import GqakitError
from gqakit.names import NameTable

BATCH_TOKENS = 1024  # calibration tokens per refinement step
HELDOUT_FRACTION = 8  # one calibration sequence in 8 (at least one) is held out to stop early
# Adam's default learning rate. SmolLM2-135M -> MQA, calibrated start, 200 steps on 4k tokens: zero-shot
# perplexity 30.9 at 1e-3 against 36.2 at 3e-4 (docs/convert.md); the held-out check keeps a layer that
# 1e-3 overfits at its best step, and one it diverges at its merge.
REFINE_LR = 1e-3
# The query/key side's own default rate. At 100 steps on 4k tokens, 3e-3 against REFINE_LR for every
# parameter (docs/convert.md): SmolLM2-135M -> MQA zero-shot 32.14 vs 32.55, and lower on every seed
# measured; the replicate model -> MQA 237.23 vs 237.45 over three seeds, lower on each; same time and
# memory.
REFINE_QK_LR = 3e-3

# How a refinement batch's error is measured (for gqakit.json). The two differ where a model holds some
# tokens far larger than the rest (SmolLM2's first token: up to 170x the median token's size).
LOSSES = {
    "relative": "the batch's squared error over the target's square: every token's error counts at its "
    "full size, however large the state it lands in",
    "per-token": "each token's squared error over the mean square of the residual state it lands in (what "
    "the next layer's norm divides it by): errors count as the next layer sees them, so a token held at "
    "100x the usual size (many models' first token) counts for little",
}


@dataclass(frozen=True)
class RefineTarget:
    """What a converted block is fitted to, and how its error is measured.

    Attributes:
        help: one line for ``--help`` and gqakit.json.
        corrective: fitted to the original decoder layer's output (the converted attention inside a
            copy of the original layer; only the attention weights move), not the attention block's,
            reading the hidden states of the model converted so far (its layers already refined): aimed
            at the original's result on the original's states, each layer also corrects what the layers
            before it lost.
        loss: how its error is measured (:data:`LOSSES`): the loss measured better with the target.
    """

    help: str
    corrective: bool = False
    loss: str = "relative"


# What a converted attention block is fitted to (``refine_target``).
REFINE_TARGETS: NameTable[RefineTarget] = NameTable(
    "refine target",
    {
        "attention": RefineTarget("the original attention block's output, on the original's inputs"),
        "layer-corrective": RefineTarget(
            "the original decoder layer's output on the original's inputs, from the converted model's "
            "inputs; only the attention weights move",
            corrective=True,
            loss="per-token",
        ),
    },
    summary=lambda t: t.help,
)


def refine_record(
    o: Any, tokens: int, heldout_tokens: int, layers: list[dict[str, Any]], elapsed_s: float
) -> dict[str, Any]:
    """What refinement did, for gqakit.json: the settings (``o``: the resolved
    :class:`~gqakit.convert.options.ConvertOptions`), the calibration tokens the blocks were fitted
    on and those held out to choose each block's best step, per layer the relative errors before and
    after on both (:func:`fit_block`), the seconds spent, and a one-line ``summary`` of what was kept: the
    steps and the layers they improved, or that no step was kept (no layer's held-out error ever fell
    below its merge's)."""
    target = REFINE_TARGETS[o.refine_target]
    kept = sum(1 for layer in layers if layer["best_step"])
    summary = f"refined {o.refine_steps} steps/layer, {kept} of {len(layers)} layers improved"
    if not kept:
        summary = (
            f"refinement kept no step: in {o.refine_steps} steps/layer no layer's held-out error fell below "
            "its merge's"
        )
    return {
        "steps": o.refine_steps,
        "lr": o.refine_lr,
        "seed": o.seed,
        "tokens": tokens,
        "heldout_tokens": heldout_tokens,
        "target": o.refine_target,
        "qk_lr": o.refine_qk_lr,
        "loss": target.loss,
        "objective": f"per layer, {LOSSES[target.loss]}, against {target.help}; all attention parameters "
        "trained; each layer keeps its weights at the best held-out error (best_step 0: the merge)",
        "summary": summary,
        "attention_error": layers,
        "elapsed_s": round(elapsed_s, 3),
    }


def to_float(obj: Any) -> Any:
    """``obj`` with every floating tensor in it (through tuples, lists and dicts) cast to float32."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() else obj
    if isinstance(obj, tuple | list):
        return type(obj)(to_float(o) for o in obj)
    if isinstance(obj, dict):
        return {k: to_float(v) for k, v in obj.items()}
    return obj


def layer_output(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def token_weights(residual: torch.Tensor) -> torch.Tensor:
    """Per-token weights of the ``per-token`` loss (:data:`LOSSES`): one over the mean
    square of each token's ``residual`` state (``[..., hidden]``), shaped ``[..., 1]``."""
    return 1.0 / residual.float().pow(2).mean(-1, keepdim=True).clamp_min(1e-12)


def _weighted(squares: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """``squares`` with each token's terms multiplied by its ``weight`` (None: as they are)."""
    return squares if weight is None else squares * weight


def attention_error(
    module: torch.nn.Module, captured: Sequence[tuple], weights: Sequence[torch.Tensor | None] | None = None
) -> float:
    """``sum ||module(x) - y||^2 / sum ||y||^2`` over the captured batches, each token's terms multiplied
    by its weight in ``weights`` (one per batch) when given."""
    num = den = 0.0
    with torch.no_grad():
        for b, (args, kwargs, target) in enumerate(captured):
            w = weights[b] if weights else None
            num += float(_weighted((layer_output(module(*args, **kwargs)) - target).pow(2), w).sum())
            den += float(_weighted(target.pow(2), w).sum())
    return num / den if den > 0 else 0.0


def fit_block(
    module: torch.nn.Module,
    fit: Sequence[tuple],
    check: Sequence[tuple],
    steps: int,
    lr: float,
    qk_lr: float | None = None,
    seed: int = 0,
    trained: torch.nn.Module | None = None,
    qk_params: Sequence[str] = (),
    weights: Sequence[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Adam on ``module``'s floating parameters towards the ``fit`` batches' outputs, keeping the weights
    that do best on the held-out ``check`` batches.

    The held-out error is measured at the start and every ``steps // 10`` steps; the weights at its
    minimum are kept (the merge itself, when no step improves on it), so refinement never makes a layer
    worse on text it did not fit and overfitting a short calibration text stops early.

    Args:
        module: what is run on the batches: the attention block, or a decoder layer holding it.
        fit, check: ``(args, kwargs, target)`` batches fitted on, and held out.
        steps, lr: Adam steps and learning rate.
        qk_lr: the learning rate of the query/key-side parameters ``qk_params`` (names in ``trained``);
            None: ``lr`` (a fused qkv projection is one tensor and takes ``lr``).
        seed: orders the calibration batches.
        trained: the module whose parameters move (default ``module``).
        weights: per-token weights (``[..., 1]``, see :func:`token_weights`) of the ``fit`` then the
            ``check`` batches, one per batch, for the ``per-token`` loss; None: unweighted.

    Returns:
        Relative errors ``before``/``after`` on the fit batches, ``heldout_before``/``heldout_after`` on
        the check batches (both weighted as the fit is), and ``best_step`` (0: the merge was kept).
    """
    fit_w, check_w = (weights[: len(fit)], weights[len(fit) :]) if weights is not None else (None, None)
    named = [(n, p) for n, p in (trained or module).named_parameters() if p.is_floating_point()]
    params = [p for _, p in named]
    before, best = attention_error(module, fit, fit_w), attention_error(module, check, check_w)
    heldout_before, best_step = best, 0
    best_params = [p.detach().clone() for p in params]
    scale = sum(
        float(_weighted(t.pow(2), fit_w[b] if fit_w else None).mean()) for b, (_, _, t) in enumerate(fit)
    )
    scale /= len(fit)
    every = max(1, steps // 10)
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.requires_grad_(True)
    qk = [p for n, p in named if n in set(qk_params)] if qk_lr is not None else []
    rest = [p for n, p in named if not any(p is q for q in qk)]
    groups = [{"params": rest, "lr": lr}] + ([{"params": qk, "lr": qk_lr}] if qk else [])
    opt = torch.optim.Adam(groups, lr=lr)
    order: list[int] = []
    for step in range(1, steps + 1):
        if not order:  # a fresh random pass over the batches
            order = torch.randperm(len(fit), generator=gen).tolist()
        b = order.pop()
        args, kwargs, target = fit[b]
        err = (layer_output(module(*args, **kwargs)) - target).pow(2)
        loss = _weighted(err, fit_w[b] if fit_w else None).mean() / scale
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % every == 0 or step == steps:
            held = attention_error(module, check, check_w)
            if held < best:  # NaN compares False: a diverged fit is never kept
                best, best_step = held, step
                best_params = [p.detach().clone() for p in params]
    for p in params:
        p.requires_grad_(False)
    with torch.no_grad():
        for p, b in zip(params, best_params, strict=True):
            p.copy_(b)
    return {
        "before": round(before, 6),
        "after": round(attention_error(module, fit, fit_w), 6),
        "heldout_before": round(heldout_before, 6),
        "heldout_after": round(best, 6),
        "best_step": best_step,
    }


def check_sequences(sequences: Sequence[torch.Tensor]) -> None:
    """Raise a clear error unless ``sequences`` leave one to hold out (see :func:`fit_block`)."""
    if len(sequences) < 2:
        raise GqakitError(
            f"--refine-steps needs at least 2 calibration sequences (one is held out to stop early), but "
            f"--calib-tokens {len(sequences[0])} fills only one; raise --calib-tokens (4096, the default, "
            f"makes 8 sequences of 512 tokens)."
        )


def split_batches(sequences: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The calibration ``sequences`` as refinement batches: those the blocks are fitted on, and those
    held out to pick each block's best step (one sequence in :data:`HELDOUT_FRACTION`, at least one,
    taken from the end)."""
    check_sequences(sequences)
    held = max(1, len(sequences) // HELDOUT_FRACTION)
    per_batch = max(1, BATCH_TOKENS // max(len(s) for s in sequences))
    return list(batches(sequences[:-held], per_batch)), list(batches(sequences[-held:], per_batch))
