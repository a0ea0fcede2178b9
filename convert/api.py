"""The typed entry points behind ``gqakit convert`` and ``gqakit expand``.

Options live in :mod:`gqakit.convert.options`, the writer in :mod:`gqakit.convert.write` and
``gqakit inspect`` in :mod:`gqakit.convert.inspect` (re-exported here with the options).
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from gqakit.checkpoint import Checkpoint, resolve_checkpoint
from gqakit.convert.calibrate import calibration_sequences
from gqakit.convert.inspect import inspect_checkpoint
from gqakit.convert.layerwise import write_layerwise
from gqakit.convert.layerwise_resume import claim_layerwise, resume_key
from gqakit.convert.methods import METHODS
from gqakit.convert.options import DTYPE_CHOICES, PRESETS, ConvertOptions, check_groups
from gqakit.convert.plan import RegroupSpec, plan_regroup
from gqakit.convert.refine import check_sequences
from gqakit.convert.retarget import convert_retargeted
from gqakit.convert.write import ConvertResult, source_path, write_converted
from gqakit.errors import GqakitError
from gqakit.families import family_of, get_adapter
from gqakit.family_parts import ArchAdapter
from gqakit.geometry import AttentionGeometry
from gqakit.problems import Problems, check_options
from gqakit.storage import check_output_dir


def convert_checkpoint(
    src: str | Path, dst: str | Path, options: ConvertOptions, progress: bool = True
) -> ConvertResult:
    """Convert a checkpoint to ``options.groups`` K/V heads, streaming, into a new directory.

    Mean, first and random pooling stream the checkpoint tensor by tensor. Calibrated merges and
    refinement run the model one decoder layer at a time (:mod:`gqakit.convert.layerwise`),
    writing each layer as soon as it is converted. Everything a user can get wrong (options, groups,
    the calibration text, DST) is checked before the first layer runs.

    Args:
        src: a checkpoint directory, a ``.gguf`` file or a hub id.
        dst: the output directory; written atomically.
        options: what to do; a preset that needs text and is given none calibrates on the wiki-en
            asset's train split (:func:`with_calibration_text`).
        progress: progress bars (in bytes, or in layers for the layer-by-layer path); pipelines that
            print their own steps turn them off. Not an option of the conversion: the output is the same.

    Returns:
        A :class:`ConvertResult` describing the output.

    Raises:
        GqakitError: for any input a user can fix; nothing is left at ``dst`` then.
    """
    check_options(options, "convert")
    _check_dst(src, dst, options.force)
    start = time.perf_counter()
    options = with_calibration_text(options).resolved()
    with resolve_checkpoint(src) as ckpt:
        if family_of(ckpt.model_type).retarget is not None:  # converted through a stock class
            return convert_retargeted(ckpt, dst, options, start, partial(_convert, progress=progress))
        return _convert(ckpt, dst, options, start, progress=progress)


def _convert(
    ckpt: Checkpoint,
    dst: str | Path,
    options: ConvertOptions,
    start: float,
    extra: dict[str, Any] | None = None,
    progress: bool = True,
    attention: ArchAdapter | None = None,
    kv_config: dict[str, Any] | None = None,
) -> ConvertResult:
    """Convert an open checkpoint of a family in the adapter registry, or of a rewrite's target class
    (its ``attention``, and ``kv_config``: the config entries that state G in that class, by default
    ``num_key_value_heads``); ``extra`` joins the provenance."""
    adapter = attention or get_adapter(ckpt.model_type)
    kv_config = kv_config or {"num_key_value_heads": options.groups}
    geom = AttentionGeometry.from_config(ckpt.config)
    check_groups(geom, options.groups)
    spec = RegroupSpec(
        target=options.groups,
        method=options.method,
        seed=options.seed,
        std=float(ckpt.config.get("initializer_range", 0.02)),
        out_dtype=DTYPE_CHOICES[options.dtype],
    )
    record: dict[str, Any] = {
        "command": "convert",
        "groups": options.groups,
        "method": options.method,
        "dtype": options.dtype,
        **options.provenance,
        **(extra or {}),
    }
    if METHODS[options.method].fresh:
        record["seed"] = options.seed
    write = partial(
        write_converted, ckpt, dst, geom=geom, groups=options.groups, out_dtype=spec.out_dtype,
        force=options.force, record=record, start=start, config={**ckpt.config, **kv_config},
    )  # fmt: skip
    if not options.needs_text:
        return write(plan_regroup(ckpt.tensor_infos(), adapter, geom, spec), progress=progress)
    # tokenized (and checked) before DST is claimed and any layer runs
    sequences = calibration_sequences(ckpt, options.calib_data, options.calib_tokens)  # type: ignore[arg-type]
    if options.refine_steps:
        check_sequences(sequences)
    key = resume_key(ckpt, options, sequences)
    with claim_layerwise(dst, options.force, source_path(ckpt), key) as resume:
        job = (ckpt, adapter, geom, spec, options, sequences, record, kv_config)
        return write(partial(write_layerwise, *job, resume=resume, progress=progress))


def _check_dst(src: str | Path, dst: str | Path, force: bool) -> None:
    """DST checked before SRC is fetched, dequantized or read (and again, when written)."""
    local = Path(src).expanduser()
    check_output_dir(Path(dst), force, local if local.is_dir() else None)


def with_calibration_text(options: ConvertOptions) -> ConvertOptions:
    """``options`` with the wiki-en asset's train split as ``calib_data`` when a preset that needs text
    is given none (:attr:`ConvertOptions.wiki_text`; fetched once into the asset cache, as the demo
    does), saying so in one line; otherwise ``options`` as they are."""
    if not options.wiki_text:
        return options
    from gqakit.assets import fetch_asset  # deferred: only a preset without text needs it

    train = fetch_asset("wiki-en")["train"]
    f = Problems("convert").flag
    print(
        f"{f('preset')} {options.preset} ({PRESETS[options.preset].method}) needs calibration text and no "  # type: ignore[index]
        f"{f('calib_data')} was given: calibrating on the wiki-en asset's train split, {train}.",
        file=sys.stderr,
    )
    return replace(options, calib_data=str(train))


def expand_checkpoint(
    src: str | Path, dst: str | Path, dtype: str = "keep", force: bool = False, progress: bool = True
) -> ConvertResult:
    """GQA/MQA -> MHA: repeat each K/V head over its group. The output computes exactly the same logits.
    ``progress`` False: no progress bar."""
    if dtype not in DTYPE_CHOICES:
        flag = Problems("expand").flag("dtype")
        raise GqakitError(f"{flag} {dtype!r} is unknown; choose one of {', '.join(DTYPE_CHOICES)}.")
    _check_dst(src, dst, force)
    start = time.perf_counter()
    with resolve_checkpoint(src) as ckpt:
        adapter = get_adapter(ckpt.model_type)
        geom = AttentionGeometry.from_config(ckpt.config)
        spec = RegroupSpec(target=geom.num_heads, method="mean", out_dtype=DTYPE_CHOICES[dtype])
        plan = plan_regroup(ckpt.tensor_infos(), adapter, geom, spec)
        record = {"command": "expand", "groups": geom.num_heads, "method": "repeat", "dtype": dtype}
        config = {**ckpt.config, "num_key_value_heads": geom.num_heads}
        return write_converted(
            ckpt, dst, plan, geom, geom.num_heads, spec.out_dtype, force, record, start, config, progress
        )


__all__ = ["ConvertOptions", "convert_checkpoint", "expand_checkpoint", "inspect_checkpoint"]
