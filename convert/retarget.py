"""Converting a family whose transformers class has one K/V head per query head (GPT-2, OPT, GPT-NeoX)
through the stock class its entry in :data:`gqakit.families.FAMILIES` names: the checks, the exact MHA
rewrite into a temporary directory, then the ordinary conversion of that (every method and refinement).
A ``gpt_bigcode`` target states G as ``multi_query`` and so holds only G = 1 or G = H.
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
from gqakit.storage import write_json

Config = dict[str, Any]
ConvertFn = Callable[..., ConvertResult]


def _class_refusals(retarget: Retarget, config: Config, groups: int | None, flag: str) -> list[str]:
    """Why ``retarget``'s class cannot hold ``config``'s checkpoint exactly (its config's refusals), nor,
    unless ``groups`` is None, ``groups`` K/V heads (named ``flag``)."""
    found = retarget.problems(config)
    heads = AttentionGeometry.from_config(config).num_heads
    valid = retarget.valid_groups(heads)
    if groups is not None and groups not in valid:
        holds = "any G dividing" if retarget.any_groups else "only G = 1 (multi_query) or G ="
        found.append(
            f"{flag} {groups}: {retarget.target} holds {holds} {heads} heads; choose one of "
            f"{', '.join(map(str, valid))}"
        )
    return found


def groups_problem(config: Config, groups: int) -> str | None:
    """Why ``config``'s checkpoint cannot be converted to ``groups`` K/V heads (None when it can): for a
    family converted through a stock class, that class's G and the config's refusals; else
    :func:`~gqakit.convert.options.check_groups`'s message."""
    retarget = family_of(config).retarget
    if retarget is None:
        try:
            check_groups(AttentionGeometry.from_config(config), groups)
        except GqakitError as e:
            return e.message
        return None
    if not (reasons := _class_refusals(retarget, config, groups, "G =")):
        return None
    return f"{config['model_type']} converts into {retarget.target}, but: {'; '.join(reasons)}."


def refusals(ckpt: Checkpoint, options: ConvertOptions | None = None) -> list[str]:
    """Every reason ``ckpt``, of a family converted through a stock class, cannot be converted exactly
    (with ``options``, as they ask): its config, then (when the config is one the class holds) its
    weights; none for a family converted as it is. ``inspect``, ``convert`` and ``recovery`` all check
    these."""
    retarget = family_of(ckpt.model_type).retarget
    if retarget is None:
        return []
    groups = None if options is None else options.groups
    found = _class_refusals(retarget, ckpt.config, groups, Problems("convert").flag("groups"))
    if not found:
        with ckpt.reader() as reader:
            found = resolve(retarget.rewrite).weight_problems(reader.read, ckpt.config)
    return [f"{reason}." for reason in found]


def convert_retargeted(
    ckpt: Checkpoint, dst: str | Path, options: ConvertOptions, start: float, convert: ConvertFn
) -> ConvertResult:
    """Convert ``ckpt`` of a family with a ``retarget`` entry to ``options.groups`` K/V heads of its
    target class.

    ``options`` are validated and resolved; ``start`` is when the command started; ``convert`` is the
    ordinary conversion of an open checkpoint (``gqakit.convert.api``). Every reason the source or the
    options cannot be held is one :class:`GqakitError`, before anything is written.
    """
    retarget = family_of(ckpt.model_type).retarget
    assert retarget is not None, ckpt.model_type
    found = refusals(ckpt, options)
    if found:
        what = f"{ckpt.origin} ({ckpt.model_type}) cannot be converted exactly into {retarget.target}:"
        raise GqakitError(" ".join([what, *found]))
    rewrite: Rewrite = resolve(retarget.rewrite)
    with ckpt.reader() as reader:  # the retargeted families are rewritten whole, in memory
        state = rewrite.state({name: reader.read(name) for name in ckpt.tensor_infos()}, ckpt.config)
    config = rewrite.config(ckpt.config)
    extra: dict[str, Any] = {"retargeted": {"from": ckpt.model_type, "to": retarget.target}}
    kv_config = None  # a class that holds any G states it as num_key_value_heads
    if not retarget.any_groups:  # gpt_bigcode: one K/V head for all (multi_query), or one per query head
        kv_config = {"multi_query": options.groups < config["n_head"]}
    with tempfile.TemporaryDirectory(prefix="gqakit-retarget-") as tmp:
        mha = Path(tmp)
        copy_non_weight_files(ckpt.path, mha)
        state = {k: v.contiguous() for k, v in state.items()}
        save_file(state, str(mha / "model.safetensors"), {"format": "pt"})
        write_json(mha / "config.json", config)
        del state
        with resolve_checkpoint(mha) as target:
            target.origin = ckpt.origin  # the provenance names what the user gave
            target.derived_from = ckpt  # ... and hashes its files, not the rewrite's
            return convert(
                target, dst, options, start, extra, attention=rewrite.attention, kv_config=kv_config
            )
