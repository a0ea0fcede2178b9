"""The typed entry points behind ``gqakit eval``: every check before any weights load, then each model
measured by its engine (:data:`~gqakit.eval.engines.ENGINES`) one at a time: the peak memory is one model's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from gqakit.checkpoint import model_source
from gqakit.console import quiet_transformers
from gqakit.errors import GqakitError
from gqakit.eval.engines import ENGINES
from gqakit.eval.lm_eval_bridge import check_tasks, parse_lm_eval_args
from gqakit.eval.options import DEFAULT_CONTEXTS, EvalOptions
from gqakit.eval.results import EvalResults, ModelResult, environment
from gqakit.models import causal_lm_config, max_positions, resolve_device
from gqakit.names import resolve
from gqakit.text import load_texts

log = logging.getLogger(__name__)


def _contexts_for(options: EvalOptions, config) -> tuple[list[int], list[str]]:
    """The decode contexts to run for a model, and problems with an explicit grid."""
    limit = max_positions(config)
    if options.contexts is None:
        fit = [c for c in DEFAULT_CONTEXTS if limit is None or c + options.new_tokens <= limit]
        return fit or [max(2, limit - options.new_tokens)], []
    too_long = [c for c in options.contexts if limit is not None and c + options.new_tokens > limit]
    if too_long:
        return [], [
            f"--contexts {','.join(map(str, too_long))} plus --new-tokens {options.new_tokens} is more "
            f"than the {limit} positions of this model; use contexts up to {limit - options.new_tokens}."
        ]
    return list(options.contexts), []


def _preflight(models: dict[str, str], options: EvalOptions) -> tuple[dict[str, Any], list[str] | None]:
    """Check every model's config, the data and the tasks before loading weights; report all problems at
    once. Returns the configs and the evaluation texts."""
    problems, configs = [], {}
    try:
        if ENGINES[options.engine].requires:  # raises with the install command
            resolve(ENGINES[options.engine].requires)(options)
    except GqakitError as e:
        problems.append(e.message)
    for label, path in models.items():
        try:
            models[label] = path = model_source(path)  # the same SRC forms as every command
            config = causal_lm_config(path)
        except GqakitError as e:
            problems.append(f"[{label}] {e.message}")
            continue
        configs[label] = config
        limit = max_positions(config)
        if (options.ppl_data or options.tasks) and limit is not None and options.seq_len > limit:
            problems.append(
                f"[{label}] --seq-len {options.seq_len} is more than this model's {limit} positions "
                f"(max_position_embeddings); use --seq-len {limit} or less."
            )
        if options.bench:
            problems += [f"[{label}] {p}" for p in _contexts_for(options, config)[1]]
    texts = None
    if options.ppl_data:
        try:
            texts = load_texts(options.ppl_data, options.text_field, options.split, options.data_config)
        except GqakitError as e:
            problems.append(e.message)
    if options.tasks:
        try:
            check_tasks(options.tasks, parse_lm_eval_args(options.lm_eval_args))
        except GqakitError as e:
            problems.append(e.message)
    if problems:
        raise GqakitError("\n".join(problems))
    return configs, texts


def evaluate(candidate: str, baseline: str | None = None, options: EvalOptions | None = None) -> EvalResults:
    """Evaluate ``candidate`` (and ``baseline`` when given) with ``options``; see :func:`evaluate_models`."""
    options = options or EvalOptions()
    paths = [baseline, candidate] if baseline else [candidate]
    names = [Path(p.rstrip("/")).name or p for p in paths]  # the directories' names, numbered when alike
    labels = names if len(set(names)) == len(names) else [f"{n} ({i + 1})" for i, n in enumerate(names)]
    return evaluate_models(
        dict(zip(labels, paths, strict=True)), options, baseline=labels[0] if baseline else None
    )


def evaluate_models(models: dict[str, str], options: EvalOptions, baseline: str | None = None) -> EvalResults:
    """Evaluate labelled checkpoints one after another, with one set of options.

    Args:
        models: label -> checkpoint directory or hub id, in table order.
        options: what to measure.
        baseline: the label the others are compared with; None: the first label when there are two or
            more models.

    Returns:
        :class:`EvalResults`; write it with :func:`gqakit.eval.report.write_report`.

    Raises:
        GqakitError: for any input a user can fix, before heavy work where possible.
    """
    if not models:
        raise GqakitError("No model to evaluate.")
    if baseline is None and len(models) > 1:
        baseline = next(iter(models))
    if baseline is not None and baseline not in models:
        raise GqakitError(f"Baseline {baseline!r} is not one of the models: {', '.join(models)}.")
    quiet_transformers()  # gqakit's own line per model, not the libraries' bars
    models = dict(models)  # each made a local directory by _preflight (a .gguf dequantized once)
    configs, texts = _preflight(models, options)
    env = environment(resolve_device(options.device), options.command_line)
    results: dict[str, ModelResult] = {}
    # Baseline first, so its numbers are there when the others are logged.
    measure = resolve(ENGINES[options.engine].measure)
    for label in sorted(models, key=lambda k: k != baseline):  # a stable sort: the others keep their order
        log.info("[%s] measuring %s (%s)", label, models[label], options.engine)
        contexts = _contexts_for(options, configs[label])[0]
        results[label] = measure(
            label, models[label], config=configs[label], options=options, texts=texts, contexts=contexts
        )
        log.info("[%s] %s", label, results[label].describe())
    ordered = {label: results[label] for label in models}
    return EvalResults(models=ordered, baseline=baseline, options=options, environment=env)
