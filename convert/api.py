"""The typed entry points behind ``gqakit convert`` and ``gqakit expand``.

Options live in :mod:`gqakit.convert.options`, the writer in :mod:`gqakit.convert.write` and
``gqakit inspect`` in :mod:`gqakit.convert.inspect`; they are re-exported here for callers that import
the whole API from one place.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from gqakit.checkpoint import Checkpoint, resolve_checkpoint
from gqakit.cli_options import Problems
from gqakit.convert.calibrate import calibrate, calibration_sequences
from gqakit.convert.inspect import Inspection, inspect_checkpoint
from gqakit.convert.layerwise import write_layerwise
from gqakit.convert.layerwise_resume import LayerwiseResume, claim_layerwise, resume_dir, tokens_digest
from gqakit.convert.merge_fit import fit_layer_merges, merge_report
from gqakit.convert.merge_plan import plan_merged
from gqakit.convert.methods import METHODS
from gqakit.convert.options import DTYPE_CHOICES, ConvertOptions, check_groups
from gqakit.convert.plan import OutputTensor, RegroupSpec, plan_regroup
from gqakit.convert.refine import check_sequences
from gqakit.convert.registry import ArchAdapter, get_adapter
from gqakit.convert.retarget import RETARGETS
from gqakit.convert.retarget_convert import convert_retargeted
from gqakit.convert.write import ConvertResult, source_path, write_converted
from gqakit.errors import GqakitError
from gqakit.files import fingerprint
from gqakit.geometry import AttentionGeometry
from gqakit.safetensors_io import DTYPES


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
        options: what to do.
        progress: progress bars (in bytes, or in layers for the layer-by-layer path); pipelines that
            print their own steps turn them off. Not an option of the conversion: the output is the same.

    Returns:
        A :class:`ConvertResult` describing the output.

    Raises:
        GqakitError: for any input a user can fix; nothing is left at ``dst`` then.
    """
    options.validate()
    start = time.perf_counter()
    with resolve_checkpoint(src) as ckpt:
        if ckpt.model_type in RETARGETS:
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
        **(extra or {}),
    }
    if METHODS[options.method].fresh:
        record["seed"] = options.seed
    weights: list[OutputTensor] | Any
    if options.merged or options.refine_steps:
        # tokenized (and checked) before DST is claimed and any layer runs
        sequences = calibration_sequences(ckpt, options.calib_data, options.calib_tokens)  # type: ignore[arg-type]
        if options.refine_steps:
            check_sequences(sequences)
        with claim_layerwise(dst, options.force, source_path(ckpt)):
            resume = LayerwiseResume(resume_dir(dst), _resume_key(ckpt, options, sequences))
            weights = partial(
                write_layerwise,
                ckpt,
                adapter,
                geom,
                spec,
                options,
                sequences,
                record,
                resume=resume,
                progress=progress,
            )
            try:
                result = write_converted(
                    ckpt, dst, weights, geom, options.groups, spec.out_dtype, options.force, record, start
                )
            except GqakitError:  # bad input: nothing to resume, nothing left behind
                resume.clear()
                raise
            except BaseException:  # killed, out of memory...: keep the finished layers for the next run
                if resume.done:
                    print(
                        f"{resume.done} finished layer(s) kept in {resume.root}: run the same conversion "
                        "again to resume there.",
                        file=sys.stderr,
                    )
                raise
            resume.clear()
            return result
    weights = plan_regroup(ckpt.tensor_infos(), adapter, geom, spec)
    return write_converted(
        ckpt,
        dst,
        weights,
        geom,
        options.groups,
        spec.out_dtype,
        options.force,
        record,
        start,
        progress=progress,
    )


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
    stats=None,
    model=None,
    sequences=None,
) -> tuple[list[OutputTensor], dict[str, Any]]:
    """The whole-model merged plan: calibrate over a loaded model (unless ``stats`` is given; on ``model``
    and ``sequences`` when they are at hand already), fit every layer's merges, and plan; return the plan
    and its record. ``gqakit probe`` uses it to share one calibration among many conversions."""
    if stats is None and options.calib_data:
        stats = calibrate(
            ckpt,
            adapter,
            geom,
            options.calib_data,
            options.calib_tokens,
            options.device,
            model=model,
            sequences=sequences,
        )
    merges, key_merge = fit_layer_merges(
        ckpt, adapter, geom, stats, options.groups, options.method, options.grouping
    )
    plan = plan_merged(ckpt.tensor_infos(), adapter, geom, spec, merges)
    return plan, merge_report(options.method, options.grouping, key_merge, stats, merges).to_record()


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
    "DTYPES",
    "ConvertOptions",
    "ConvertResult",
    "Inspection",
    "check_groups",
    "convert_checkpoint",
    "expand_checkpoint",
    "inspect_checkpoint",
    "plan_with_merges",
    "write_converted",
]
