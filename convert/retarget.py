"""Converting a family whose transformers class has one K/V head per query head (GPT-2, OPT, GPT-NeoX)
through the stock class its entry in :data:`gqakit.families.FAMILIES` names: the checks, the exact MHA
rewrite, then G heads.

The rewrite into the target family's MHA checkpoint (logits equal to the source's) goes to a temporary
directory, which then converts through the ordinary path (every method, grouping and refinement) and is
written by :func:`gqakit.convert.write.write_converted`, atomically. A ``gpt_bigcode`` target states G
as ``multi_query`` and so holds only G = 1 or G = H.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from gqakit.checkpoint import Checkpoint, copy_non_weight_files, resolve_checkpoint
from gqakit.convert.options import ConvertOptions, check_groups
from gqakit.convert.write import ConvertResult
from gqakit.errors import GqakitError
from gqakit.families import family_of
from gqakit.family_parts import Retarget, Rewrite
from gqakit.geometry import AttentionGeometry
from gqakit.names import resolve
from gqakit.problems import Problems
from gqakit.storage import check_output_dir, write_json

Config = dict[str, Any]
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
        heads = AttentionGeometry.from_config(ckpt.config).num_heads
        if (reason := _groups_reason(retarget, heads, options.groups)) is not None:
            found.append(f"{Problems('convert').flag('groups')} {options.groups}: {reason}.")
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
        convert: the ordinary conversion of an open checkpoint (``gqakit.convert.api``).

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
    with ckpt.reader() as reader:  # the retargeted families are rewritten whole, in memory
        state = rewrite.state({name: reader.read(name) for name in ckpt.tensor_infos()}, ckpt.config)
    config = rewrite.config(ckpt.config)
    extra: dict[str, Any] = {"retargeted": {"from": ckpt.model_type, "to": retarget.target}}
    kv_config = None  # a class that holds any G states it as num_key_value_heads
    if not retarget.any_groups:  # gpt_bigcode: one K/V head for all (multi_query), or one per query head
        kv_config = {"multi_query": options.groups < config["n_head"]}
    with tempfile.TemporaryDirectory(prefix="gqakit-retarget-") as tmp:
        mha = Path(tmp) / "mha"
        mha.mkdir()
        copy_non_weight_files(ckpt.path, mha)
        tensors = {k: v.contiguous() for k, v in state.items()}
        save_file(tensors, str(mha / "model.safetensors"), {"format": "pt"})
        write_json(mha / "config.json", config)
        del state, tensors
        with resolve_checkpoint(mha) as target:
            target.origin = ckpt.origin  # the provenance names what the user gave
            target.derived_from = ckpt  # ... and hashes its files, not the rewrite's
            return convert(
                target, dst, options, start, extra, attention=rewrite.attention, kv_config=kv_config
            )
