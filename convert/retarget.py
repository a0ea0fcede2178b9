"""Converting a family whose transformers class has one K/V head per query head (GPT-2, OPT, GPT-NeoX)
through the stock class its entry in :data:`gqakit.families.FAMILIES` names: the checks, the exact MHA
rewrite, then G heads.

The rewrite into the target family's MHA checkpoint (logits equal to the source's) goes to a temporary
directory; a ``phi`` target then converts through the ordinary path (every method, grouping and
refinement), a ``gpt_bigcode`` target is pooled or merged here (it holds G = 1 or G = H only). Both are
written by :func:`gqakit.convert.write.write_converted`, atomically.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gqakit.checkpoint import Checkpoint, copy_non_weight_files, resolve_checkpoint
from gqakit.convert.calibrate import calibration_sequences
from gqakit.convert.methods import POOLING_METHODS
from gqakit.convert.options import DTYPE_CHOICES, ConvertOptions, check_groups
from gqakit.convert.refine import RefineSettings, check_sequences
from gqakit.convert.retarget_bigcode import bigcode_to_mqa
from gqakit.convert.retarget_bigcode_merge import calibrated_mqa
from gqakit.convert.write import ConvertResult, state_writer, write_converted
from gqakit.errors import GqakitError
from gqakit.families import family_of
from gqakit.family_parts import Retarget, Rewrite
from gqakit.geometry import AttentionGeometry
from gqakit.models import resolve_device
from gqakit.names import resolve
from gqakit.problems import Problems
from gqakit.storage import check_output_dir, write_json

Config = dict[str, Any]
StateDict = dict[str, torch.Tensor]
ConvertFn = Callable[..., ConvertResult]


def rewrite_of(retarget: Retarget) -> Rewrite:
    """The :class:`Rewrite` a registry entry names (``module:attribute``)."""
    return resolve(retarget.rewrite)


def groups_problem(config: Config, groups: int) -> str | None:
    """Why ``config``'s checkpoint cannot be converted to ``groups`` K/V heads (None when it can): for a
    family converted through a stock class, that class's G and the config's refusals; else
    :func:`~gqakit.convert.options.check_groups`'s message."""
    retarget = family_of(config).retarget
    geom = AttentionGeometry.from_config(config)
    heads = geom.num_heads
    if retarget is None:
        try:
            check_groups(geom, groups)
        except GqakitError as e:
            return e.message
        return None
    reasons = retarget.problems(config)
    if (reason := _groups_reason(retarget, heads, groups)) is not None:
        reasons.append(f"G = {groups}: {reason}")
    if not reasons:
        return None
    return f"{config['model_type']} converts into {retarget.target}, but: {'; '.join(reasons)}."


def _groups_reason(retarget: Retarget, heads: int, groups: int) -> str | None:
    """Why ``retarget``'s class cannot hold ``groups`` K/V heads for ``heads`` query heads, or None."""
    valid = retarget.valid_groups(heads)
    if groups in valid:
        return None
    holds = "any G dividing" if retarget.any_groups else "only G = 1 (multi_query) or G ="
    return f"{retarget.target} holds {holds} {heads} heads; choose one of {', '.join(map(str, valid))}"


def _option_problems(config: Config, retarget: Retarget, options: ConvertOptions) -> list[str]:
    """What ``options`` ask of a family converted through ``retarget`` that its class cannot hold."""
    o = options.resolved()
    p = Problems("convert")
    heads = AttentionGeometry.from_config(config).num_heads
    if (reason := _groups_reason(retarget, heads, o.groups)) is not None:
        p.add(f"{p.flag('groups')} {o.groups}: {reason}.")
    pooled = o.method in POOLING_METHODS and not o.merged and not o.refine_steps
    if not retarget.any_groups and not pooled:
        if o.groups != 1:
            p.add(
                f"{p.flag('method')} {o.method} (or {p.flag('refine_steps')} {o.refine_steps}) at "
                f"{p.flag('groups')} {o.groups}: G = H is {retarget.target}'s exact rewrite, nothing to "
                f"merge; the calibrated merge and refinement go to {p.flag('groups')} 1."
            )
        if o.grouping != "contiguous":
            p.add(
                f"{p.flag('grouping')} {o.grouping}: a {retarget.target} target holds one K/V head, so every "
                "head is in the one group and there is nothing to choose."
            )
        if o.refine_steps and o.refine_target != "attention":
            p.add(
                f"{p.flag('refine_target')} {o.refine_target}: a {retarget.target} target is refined "
                "against the attention output only."
            )
    return p.messages


def refusals(ckpt: Checkpoint, options: ConvertOptions | None = None) -> list[str]:
    """Every reason ``ckpt``, of a family converted through a stock class, cannot be converted exactly
    (with ``options``, as they ask): its config, then (when the config is one the class holds) its
    weights; none for a family converted as it is. ``inspect``, ``convert`` and ``recovery`` all check
    these."""
    retarget = family_of(ckpt.model_type).retarget
    if retarget is None:
        return []
    found = [f"{reason}." for reason in retarget.problems(ckpt.config)]
    if options is not None:
        found += _option_problems(ckpt.config, retarget, options)
    if not found:
        with ckpt.reader() as reader:
            found = [f"{r}." for r in rewrite_of(retarget).weight_problems(reader.read, ckpt.config)]
    return found


def convert_retargeted(
    ckpt: Checkpoint, dst: str | Path, options: ConvertOptions, start: float, convert: ConvertFn
) -> ConvertResult:
    """Convert ``ckpt`` of a family with a ``retarget`` entry to ``options.groups`` K/V heads of its
    target class.

    Args:
        ckpt: an open checkpoint of such a family.
        dst: the output directory; written atomically.
        options: validated, resolved convert options.
        start: when the command started (for the provenance's elapsed time).
        convert: the ordinary conversion of an open checkpoint (``gqakit.convert.api``), for ``phi``.

    Raises:
        GqakitError: every reason the source or the options cannot be held, in one message; nothing is
            written then.
    """
    retarget = family_of(ckpt.model_type).retarget
    assert retarget is not None, ckpt.model_type
    found = refusals(ckpt, options)
    if found:
        what = f"{ckpt.origin} ({ckpt.model_type}) cannot be converted exactly into {retarget.target}:"
        raise GqakitError(" ".join([what, *found]))
    check_output_dir(Path(dst), options.force, ckpt.path)  # before the whole model is read and rewritten
    rewrite = rewrite_of(retarget)
    with ckpt.reader() as reader:  # the retargeted families are converted whole, in memory
        state = rewrite.state({name: reader.read(name) for name in ckpt.tensor_infos()}, ckpt.config)
    config = rewrite.config(ckpt.config)
    extra: dict[str, Any] = {"retargeted": {"from": ckpt.model_type, "to": retarget.target}}
    if not retarget.any_groups:  # gpt_bigcode: pooled or merged here, written once
        return _convert_bigcode(ckpt, dst, options, config, state, start, extra)
    with tempfile.TemporaryDirectory(prefix="gqakit-retarget-") as tmp:
        mha = Path(tmp) / "mha"
        mha.mkdir()
        copy_non_weight_files(ckpt.path, mha)
        state_writer(state)(mha)
        write_json(mha / "config.json", config)
        with resolve_checkpoint(mha) as target:
            target.origin = ckpt.origin  # the provenance names what the user gave
            target.derived_from = ckpt  # ... and hashes its files, not the rewrite's
            return convert(target, dst, options, start, extra)


def _convert_bigcode(
    ckpt: Checkpoint,
    dst: str | Path,
    options: ConvertOptions,
    config: Config,
    state: StateDict,
    start: float,
    extra: dict[str, Any],
) -> ConvertResult:
    """The gpt_bigcode target: G = H is the rewrite itself; G = 1 pools into its one K/V head
    (``multi_query``), or merges it calibrated or refines a pooled start
    (:mod:`gqakit.convert.retarget_bigcode_merge`), recording what it measured."""
    mqa = options.groups == 1 and config["n_head"] > 1
    pooled = None
    if mqa and options.method != "calibrated":
        pooled = bigcode_to_mqa(state, config, options.method, options.seed)  # type: ignore[arg-type]
    if pooled is not None and not options.refine_steps:
        state = pooled
    elif mqa:  # the calibrated merge, or a pooled start refined
        sequences = calibration_sequences(ckpt, options.calib_data, options.calib_tokens)  # type: ignore[arg-type]
        refine = None
        if options.refine_steps:
            check_sequences(sequences)
            refine = RefineSettings(options.refine_steps, options.refine_lr, options.seed)  # type: ignore[arg-type]
        device = resolve_device(options.device)
        state, measured = calibrated_mqa(state, config, sequences, start=pooled, refine=refine, device=device)
        tokens = sum(s.numel() for s in sequences)
        calibration = {"data": str(options.calib_data), "tokens": tokens, "device": str(device)}
        extra = {**extra, **measured, "calibration": calibration}
    record = {
        "command": "convert",
        "groups": options.groups,
        "method": options.method,
        "dtype": options.dtype,
        **options.provenance,
        **extra,
    }
    out_dtype = DTYPE_CHOICES[options.dtype]
    return write_converted(
        ckpt, dst, state_writer(state, out_dtype), AttentionGeometry.from_config(ckpt.config), options.groups,
        out_dtype, options.force, record, start, config={**config, "multi_query": mqa},
    )  # fmt: skip
