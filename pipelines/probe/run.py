"""The probe: :func:`probe_checkpoint` measures every combination (see :mod:`gqakit.pipelines.probe`)."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import asdict, replace
from functools import partial
from itertools import product
from pathlib import Path
from typing import Any

import click
import torch

from gqakit.checkpoint import resolve_checkpoint
from gqakit.cli_options import click_options, options_from
from gqakit.convert import ConvertOptions, convert_checkpoint
from gqakit.convert.calibrate import calibration_ids
from gqakit.convert.options import check_groups
from gqakit.errors import GqakitError
from gqakit.eval import perplexity
from gqakit.families import family_of, get_adapter
from gqakit.family_parts import ArchAdapter, Retarget
from gqakit.geometry import AttentionGeometry
from gqakit.models import load_causal_lm, load_tokenizer
from gqakit.pipelines.probe.options import ProbeOptions
from gqakit.pipelines.probe.report import ProbeResult, ProbeRow, write_probe
from gqakit.problems import check_options
from gqakit.storage import writable_dir
from gqakit.text import load_texts

log = logging.getLogger(__name__)


@torch.no_grad()
def attention_errors(original, converted, adapter: ArchAdapter, num_layers: int, sequences) -> list[float]:
    """Per layer, ``sum ||attn'(x) - attn(x)||^2 / sum ||attn(x)||^2`` with ``x`` the original's layer inputs.

    One layer's outputs at a time: each hook compares and keeps two running sums.
    """
    num = [0.0] * num_layers
    den = [0.0] * num_layers

    def hook(layer: int, module, args, kwargs, output) -> None:
        other = converted.get_submodule(adapter.attention_module(layer))
        ref = output[0] if isinstance(output, tuple) else output
        got = other(*args, **kwargs)
        got = got[0] if isinstance(got, tuple) else got
        num[layer] += float((got.float() - ref.float()).pow(2).sum())
        den[layer] += float(ref.float().pow(2).sum())

    handles = [
        original.get_submodule(adapter.attention_module(layer)).register_forward_hook(
            partial(hook, layer), with_kwargs=True
        )
        for layer in range(num_layers)
    ]
    device = next(original.parameters()).device
    try:
        for ids in sequences:
            original.base_model(input_ids=ids[None].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return [n / d if d > 0 else 0.0 for n, d in zip(num, den, strict=True)]


def _retargeted_hint(model_type: str, retarget: Retarget, config: dict) -> str:
    """What to do instead of probing a family that converts by an exact rewrite into another class."""
    heads = AttentionGeometry.from_config(config).num_heads
    head = (
        f"gqakit probe measures the families it converts directly; {model_type} converts by an exact "
        f"rewrite into {retarget.target}."
    )
    if retarget.any_groups:
        return (
            f"{head} Rewrite it first (`gqakit convert SRC SRC-{retarget.target} --groups {heads}`: the same "
            f"logits) and probe that."
        )
    return (
        f"{head} {retarget.target} holds only G = 1 or {heads}: compare `gqakit convert SRC OUT --groups 1 "
        "--method mean` and `--method calibrated` with `gqakit eval OUT --baseline SRC`."
    )


def _mean_error(record: dict, which: str) -> float | None:
    """A conversion's mean K or V reconstruction error over its layers (``gqakit.json``), when it fitted
    merges on calibration text; None for a plain pooling."""
    layers = record.get("reconstruction_error") or []
    return sum(e[which] for e in layers) / len(layers) if layers else None


def probe_checkpoint(src: str | Path, out_dir: str | Path | None, options: ProbeOptions) -> ProbeResult:
    """Measure every combination of ``options`` on ``src``; write the table, JSON and plot to ``out_dir``.

    Each combination is converted by ``gqakit convert``'s own code (:func:`convert_checkpoint`, the
    layer-by-layer path for the conversions that read calibration text) into a temporary directory.
    """
    check_options(options, "probe")
    if out_dir is not None:
        writable_dir(out_dir, "--out")
    with resolve_checkpoint(src) as ckpt:
        retarget = family_of(ckpt.model_type).retarget
        if retarget is not None:
            raise GqakitError(_retargeted_hint(ckpt.model_type, retarget, ckpt.config))
        adapter = get_adapter(ckpt.model_type)
        geom = AttentionGeometry.from_config(ckpt.config)
        for g in options.groups:
            check_groups(geom, g)
        tokenizer = load_tokenizer(ckpt.path)
        eval_texts = load_texts(Path(options.eval_data).expanduser(), option="--eval-data")
        error_ids = calibration_ids(
            tokenizer, eval_texts, options.error_tokens, options.seq_len, source="--eval-data"
        )
        load = partial(load_causal_lm, dtype="float32", device=options.device)
        measure = partial(
            perplexity,
            tokenizer=tokenizer,
            texts=eval_texts,
            seq_len=options.seq_len,
            batch_size=8,  # windows per forward pass
            max_tokens=options.eval_tokens,
            progress=False,
        )
        original = load(ckpt.path)
        t0 = time.perf_counter()
        base_ppl = float(measure(original).ppl)
        rows = [ProbeRow(None, "original", base_ppl, 1.0, seconds=time.perf_counter() - t0)]
        for g, method in product(options.groups, options.methods):
            t0 = time.perf_counter()
            opts = ConvertOptions(groups=g, method=method, device=options.device)
            if opts.needs_text:
                opts = replace(opts, calib_data=options.calib_data, calib_tokens=options.calib_tokens)
            with tempfile.TemporaryDirectory(prefix="gqakit-probe-") as tmp:
                convert_checkpoint(ckpt.path, Path(tmp) / "m", opts, progress=False)
                record = json.loads((Path(tmp) / "m" / "gqakit.json").read_text())
                converted = load(Path(tmp) / "m")
            errs = attention_errors(original, converted, adapter, geom.num_layers, error_ids)
            p = float(measure(converted).ppl)
            del converted
            seconds = time.perf_counter() - t0
            key_err, value_err = _mean_error(record, "key"), _mean_error(record, "value")
            rows.append(ProbeRow(g, method, p, p / base_ppl, errs, key_err, value_err, seconds))
            log.info("G=%d %s: perplexity %.2f", g, method, p)
        settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(options).items()}
        result = ProbeResult(ckpt.origin, geom, rows, settings)
    if out_dir is not None:
        write_probe(result, Path(out_dir))
    return result


@click.command("probe")
@click.argument("src")
@click_options(ProbeOptions)
def probe_cmd(src: str, **kwargs: Any) -> None:
    """Zero-training quality of SRC for each G x method: held-out perplexity and per-layer
    attention-output error, as a table, a JSON file and a plot. Pick G before spending compute."""
    options = options_from(ProbeOptions, kwargs)
    result = probe_checkpoint(src, options.out, options)
    click.echo(f"{result.to_table()}\n\nKV bytes per GPU per token, bf16, with tensor parallelism (TP GPUs):")
    click.echo(result.tensor_parallel_table())
    click.echo(f"wrote {options.out / 'probe.json'}, probe.md, probe.png")
