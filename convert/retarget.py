"""Families whose transformers class has one K/V head per query head, re-expressed exactly in a stock
class that holds fewer: the table of source family -> target family and its pure transforms.

A retargeted source converts in two steps: its tensors are rewritten as the target family's MHA
checkpoint (logits equal to the source's), then that checkpoint converts as any other of its family.
``phi`` takes every method and any G dividing H; ``gpt_bigcode`` holds only G = H or G = 1
(``multi_query``) and takes the pooling methods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gqakit.checkpoint import Checkpoint, copy_non_weight_files
from gqakit.convert.retarget_bigcode import (
    gpt2_problems,
    gpt2_to_bigcode_config,
    gpt2_to_bigcode_state,
    opt_problems,
    opt_to_bigcode_config,
    opt_to_bigcode_state,
)
from gqakit.convert.retarget_neox import (
    neox_gain_problems,
    neox_problems,
    neox_to_phi_config,
    neox_to_phi_state,
)
from gqakit.files import write_json
from gqakit.geometry import AttentionGeometry

Config = dict[str, Any]
StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Retarget:
    """How one source family becomes a stock class with a K/V-head setting.

    Attributes:
        source: the source ``config.model_type``.
        target: the target ``config.model_type``.
        why: why this target, for ``gqakit inspect``.
        problems: config -> the reasons this checkpoint cannot be held exactly (empty when it can).
        config: source config -> target MHA config.
        state: (source state dict, source config) -> target MHA state dict.
        any_groups: the target holds any G dividing H (else only 1 and H).
        weight_problems: (source state dict, source config) -> reasons found in the weights themselves
            (a zero LayerNorm gain that a fold divides by).
    """

    source: str
    target: str
    why: str
    problems: Callable[[Config], list[str]]
    config: Callable[[Config], Config]
    state: Callable[[StateDict, Config], StateDict]
    any_groups: bool
    weight_problems: Callable[[StateDict, Config], list[str]] = lambda state, config: []

    def geometry(self, config: Config) -> AttentionGeometry:
        """The attention geometry of the target MHA checkpoint ``config`` becomes."""
        return AttentionGeometry.from_config(self.config(config))

    def valid_groups(self, heads: int) -> list[int]:
        """The G the target class can hold for ``heads`` query heads."""
        if self.any_groups:
            return [g for g in range(1, heads + 1) if heads % g == 0]
        return [1, heads] if heads > 1 else [1]


RETARGETS: dict[str, Retarget] = {
    r.source: r
    for r in (
        Retarget(
            "gpt2", "gpt_bigcode",
            "GPTBigCode is GPT-2's block (learned positions, LayerNorm, GELU MLP, fused c_attn) with "
            "multi_query: one K/V head for all query heads",
            gpt2_problems, gpt2_to_bigcode_config, gpt2_to_bigcode_state, False,
        ),
        Retarget(
            "opt", "gpt_bigcode",
            "pre-LN OPT is GPT-2's block with ReLU and learned positions at an offset of 2; GPTBigCode holds "
            "it with multi_query: one K/V head for all query heads",
            opt_problems, opt_to_bigcode_config, opt_to_bigcode_state, False,
        ),
        Retarget(
            "gpt_neox", "phi",
            "Phi is GPT-NeoX's parallel attention + MLP block (LayerNorm, biases, partial rotary) with "
            "num_key_value_heads; NeoX's second LayerNorm folds into fc1",
            neox_problems, neox_to_phi_config, neox_to_phi_state, True,
            lambda state, config: neox_gain_problems(state, config["num_hidden_layers"]),
        ),
    )
}  # fmt: skip


def read_state(ckpt: Checkpoint) -> StateDict:
    """Every tensor of ``ckpt`` in memory (the retargeted families are converted whole)."""
    with ckpt.reader() as reader:
        return {name: reader.read(name) for name in ckpt.tensor_infos()}


def write_target(out: Path, config: Config, state: StateDict, src: Path) -> Path:
    """Write ``state`` and ``config`` as a Hugging Face checkpoint at ``out``, with ``src``'s tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    copy_non_weight_files(src, out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), {"format": "pt"})
    write_json(out / "config.json", config)
    return out


def retarget_groups_problem(config: Config, groups: int) -> str | None:
    """Why a retargeted ``config`` cannot be converted to ``groups`` K/V heads (None when it can)."""
    retarget = RETARGETS[config["model_type"]]
    reasons = retarget.problems(config)
    heads = retarget.geometry(config).num_heads
    if groups not in retarget.valid_groups(heads):
        valid = ", ".join(map(str, retarget.valid_groups(heads)))
        reasons.append(f"{retarget.target} holds G in {{{valid}}} for {heads} heads, not {groups}")
    if not reasons:
        return None
    return f"{config['model_type']} converts into {retarget.target}, but: {'; '.join(reasons)}."
