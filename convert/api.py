"""The typed entry points behind ``gqakit convert`` and ``gqakit expand``.

Options live in :mod:`gqakit.convert.options`, the writer in :mod:`gqakit.convert.write` and
``gqakit inspect`` in :mod:`gqakit.convert.inspect`; they are re-exported here for callers that import
the whole API from one place.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

from gqakit.checkpoint import Checkpoint, resolve_checkpoint
from gqakit.convert.calibrate import CalibrationStats, calibrate, calibration_sequences
from gqakit.convert.inspect import Inspection, inspect_checkpoint
from gqakit.convert.layerwise import write_layerwise
from gqakit.convert.layerwise_resume import claim_layerwise, tokens_digest
from gqakit.convert.merge_fit import fit_layer_merges, merge_report
from gqakit.convert.merge_plan import plan_merged
from gqakit.convert.methods import METHODS
from gqakit.convert.options import DTYPE_CHOICES, PRESETS, ConvertOptions, check_groups
from gqakit.convert.plan import OutputTensor, RegroupSpec, plan_regroup
from gqakit.convert.refine import check_sequences
from gqakit.convert.retarget import convert_retargeted
from gqakit.convert.write import ConvertResult, source_path, write_converted
from gqakit.errors import GqakitError
from gqakit.families import family_of, get_adapter
from gqakit.family_parts import ArchAdapter
from gqakit.geometry import AttentionGeometry
from gqakit.problems import Problems
from gqakit.storage import fingerprint


def convert_checkpoint(
    src: str | Path, dst: str | Path, options: ConvertOptions, progress: bool = True
) -> ConvertResult:
    """Convert a checkpoint to ``options.groups`` K/V heads, streaming, into a new directory.

    Mean, first and random pooling stream the checkpoint tensor by tensor. Calibrated merges, similarity
    grouping and refinement run the model one decoder layer at a time (:mod:`gqakit.convert.layerwise`),
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
    options.validate()
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
) -> ConvertResult:
    """Convert an open checkpoint of a family in the adapter registry; ``extra`` joins the provenance."""
    adapter = get_adapter(ckpt.model_type)
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
        force=options.force, record=record, start=start,
    )  # fmt: skip
    if not options.needs_text:
        return write(plan_regroup(ckpt.tensor_infos(), adapter, geom, spec), progress=progress)
    # tokenized (and checked) before DST is claimed and any layer runs
    sequences = calibration_sequences(ckpt, options.calib_data, options.calib_tokens)  # type: ignore[arg-type]
    if options.refine_steps:
        check_sequences(sequences)
    key = _resume_key(ckpt, options, sequences)
    with claim_layerwise(dst, options.force, source_path(ckpt), key) as resume:
        job = (ckpt, adapter, geom, spec, options, sequences, record)
        return write(partial(write_layerwise, *job, resume=resume, progress=progress))


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


def _resume_key(ckpt: Checkpoint, options: ConvertOptions, sequences: list) -> dict[str, Any]:
    """What the finished layers of a layer-wise conversion depend on: the source's files, every option
    but ``force``, and the calibration tokens."""
    origin = Path(ckpt.origin)
    return {
        "source": fingerprint(origin) if origin.exists() else ckpt.origin,
        "options": {k: v for k, v in asdict(options).items() if k != "force"},
        "tokens": tokens_digest(sequences),
    }


def plan_with_merges(
    ckpt: Checkpoint,
    adapter: ArchAdapter,
    geom: AttentionGeometry,
    spec: RegroupSpec,
    options: ConvertOptions,
    stats: CalibrationStats | None = None,
) -> tuple[list[OutputTensor], dict[str, Any]]:
    """The whole-model merged plan: calibrate over a loaded model (unless ``stats`` is given), fit every
    layer's merges, and plan; return the plan and its record. ``gqakit probe`` uses it to share one
    calibration among many conversions."""
    o = options.resolved()
    if stats is None and o.calib_data:
        stats = calibrate(ckpt, adapter, geom, o.calib_data, o.calib_tokens, o.device)  # type: ignore[arg-type]
    merges, key_merge = fit_layer_merges(ckpt, adapter, geom, stats, o.groups, o.method, o.grouping)  # type: ignore[arg-type]
    plan = plan_merged(ckpt.tensor_infos(), adapter, geom, spec, merges)
    return plan, merge_report(o.method, o.grouping, key_merge, stats, merges).to_record()  # type: ignore[arg-type]


def expand_checkpoint(
    src: str | Path, dst: str | Path, dtype: str = "keep", force: bool = False, progress: bool = True
) -> ConvertResult:
    """GQA/MQA -> MHA: repeat each K/V head over its group. The output computes exactly the same logits.
    ``progress`` False: no progress bar."""
    if dtype not in DTYPE_CHOICES:
        flag = Problems("expand").flag("dtype")
        raise GqakitError(f"{flag} {dtype!r} is unknown; choose one of {', '.join(DTYPE_CHOICES)}.")
    start = time.perf_counter()
    with resolve_checkpoint(src) as ckpt:
        adapter = get_adapter(ckpt.model_type)
        geom = AttentionGeometry.from_config(ckpt.config)
        spec = RegroupSpec(target=geom.num_heads, method="mean", out_dtype=DTYPE_CHOICES[dtype])
        plan = plan_regroup(ckpt.tensor_infos(), adapter, geom, spec)
        record = {"command": "expand", "groups": geom.num_heads, "method": "repeat", "dtype": dtype}
        return write_converted(
            ckpt, dst, plan, geom, geom.num_heads, spec.out_dtype, force, record, start, progress=progress
        )


__all__ = [
    "DTYPE_CHOICES",
    "PRESETS",
    "ConvertOptions",
    "ConvertResult",
    "Inspection",
    "check_groups",
    "convert_checkpoint",
    "expand_checkpoint",
    "inspect_checkpoint",
    "plan_with_merges",
    "with_calibration_text",
    "write_converted",
]
