"""The names a layer-wise refinement is configured by: what each converted block is fitted to
(``--refine-target``), how its rates change over its steps (``--refine-schedule``) and how a batch's error
is measured (``--refine-loss``). Each is a :class:`~gqakit.names.NameTable` of typed entries, read by the
CLI's choices, the options' checks and the fit itself (:mod:`gqakit.convert.refine`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gqakit.names import NameTable


@dataclass(frozen=True)
class RefineTarget:
    """What a converted block is fitted to, and which weights move.

    Attributes:
        help: one line for ``--help`` and gqakit.json.
        whole_layer: fitted to the original decoder layer's output (the converted attention inside a
            copy of the original layer), not the attention block's.
        moves_layer: every weight of the decoder layer moves (attention, MLP, norms), not only the
            attention weights.
        converted_inputs: the block reads the hidden states of the model converted so far (its layers
            already refined) and is fitted to the original's result on the original's states, so each
            layer also corrects what the layers before it lost. The attention block's target is then the
            original's state after the attention's residual add (input + attention output), less the
            converted layer's input.
        window: the block is fitted through two adjacent decoder layers: its own (the converted block in
            a copy of the original layer) and the next one as the original has it, to the original's
            output after both; so a block is shaped by what the next layer, softmax included, makes of
            its error. Implies ``whole_layer``; the last layer, having no next, is fitted to its own output.
        loss: the loss (:data:`REFINE_LOSSES`) the target is fitted with unless ``--refine-loss`` names
            one: the one measured better with it (docs/convert.md).
    """

    help: str
    whole_layer: bool
    moves_layer: bool = False
    converted_inputs: bool = False
    window: bool = False
    loss: str = "relative"


# What a converted attention block is fitted to (``gqakit convert --refine-target``).
REFINE_TARGETS: NameTable[RefineTarget] = NameTable(
    "refine target",
    {
        "attention": RefineTarget("the original attention block's output, on the original's inputs", False),
        "layer": RefineTarget(
            "the original decoder layer's output (attention and MLP through the residual); only the "
            "attention weights move",
            True,
            loss="per-token",
        ),
        "layer-all": RefineTarget(
            "the original decoder layer's output; every weight of the layer moves (attention, MLP, norms), "
            "so the MLP can absorb what the shared heads lose",
            True,
            moves_layer=True,
        ),
        "layer-all-corrective": RefineTarget(
            "the original decoder layer's output on the original's inputs, from the converted model's "
            "inputs; every weight of the layer moves (attention, MLP, norms)",
            True,
            moves_layer=True,
            converted_inputs=True,
            loss="per-token",
        ),
        "attention-corrective": RefineTarget(
            "the original attention block's output plus the residual drift of the layers before it, on the "
            "converted model's inputs",
            False,
            converted_inputs=True,
        ),
        "layer-corrective": RefineTarget(
            "the original decoder layer's output on the original's inputs, from the converted model's "
            "inputs; only the attention weights move",
            True,
            converted_inputs=True,
            loss="per-token",
        ),
        "window": RefineTarget(
            "the original's output two decoder layers on (this layer, then the next as the original has "
            "it); only this layer's attention weights move",
            True,
            window=True,
            loss="per-token",
        ),
        "window-corrective": RefineTarget(
            "the original's output two decoder layers on, from the converted model's inputs; only this "
            "layer's attention weights move",
            True,
            converted_inputs=True,
            window=True,
        ),
    },
    summary=lambda t: t.help,
)


def target_loss(target: str, loss: str | None) -> str:
    """The loss a refinement fits ``target`` with: ``loss`` when given, else the target's own
    (:attr:`RefineTarget.loss`)."""
    return loss if loss is not None else REFINE_TARGETS[target].loss


@dataclass(frozen=True)
class RefineSchedule:
    """How the refinement's learning rates change over a layer's steps.

    Attributes:
        help: one line for ``--help``.
        factor: the rates' multiplier at the fraction ``t`` (0 at the first step, 1 after the last) of
            the layer's steps done.
    """

    help: str
    factor: Callable[[float], float]


# How the rates change over each layer's steps (``gqakit convert --refine-schedule``).
REFINE_SCHEDULES: NameTable[RefineSchedule] = NameTable(
    "refine schedule",
    {
        "constant": RefineSchedule("the same rates at every step", lambda t: 1.0),
        "cosine": RefineSchedule(
            "the rates fall along a half cosine from their values at the first step to 0 after the last "
            "(lost to constant rates at 100 steps per layer: docs/convert.md)",
            lambda t: 0.5 * (1.0 + math.cos(math.pi * t)),
        ),
    },
    summary=lambda s: s.help,
)


@dataclass(frozen=True)
class RefineLoss:
    """How a batch's error is measured, in the fit and in the held-out check that picks its best step.

    Attributes:
        help: one line for ``--help`` and gqakit.json.
        per_token: each token's squared error is divided by the mean square of the residual state it
            lands in (what the next layer's RMS norm divides that token by), so every token weighs by
            its error as the next layer sees it; otherwise the squared errors are summed over the batch
            and divided by the target's square, so a token whose state is large (a model's first token,
            at up to 170x the median token's size in SmolLM2) weighs by its error's full size.
    """

    help: str
    per_token: bool


# How a refinement batch's error is measured (``gqakit convert --refine-loss``).
REFINE_LOSSES: NameTable[RefineLoss] = NameTable(
    "refine loss",
    {
        "relative": RefineLoss(
            "the batch's squared error over the target's square: every token's error counts at its full "
            "size, however large the state it lands in",
            False,
        ),
        "per-token": RefineLoss(
            "each token's squared error over the mean square of the residual state it lands in (what the "
            "next layer's norm divides it by): errors count as the next layer sees them, so a token held "
            "at 100x the usual size (many models' first token) counts for little",
            True,
        ),
    },
    summary=lambda s: s.help,
)


__all__ = [
    "REFINE_LOSSES",
    "REFINE_SCHEDULES",
    "REFINE_TARGETS",
    "RefineLoss",
    "RefineSchedule",
    "RefineTarget",
    "target_loss",
]
