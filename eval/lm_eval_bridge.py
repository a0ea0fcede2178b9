"""Run lm-eval tasks on a model that is already loaded (inside ``HFLM``: not loaded a second time), our
offline tasks (``eval/tasks/*.yaml``) registered as ``lm-eval --include_path`` registers them (docs/eval.md).
"""

from __future__ import annotations

import inspect
import json
import logging
import shlex
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from gqakit.cli_options import parse_list
from gqakit.errors import GqakitError, did_you_mean

log = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
# Our task names are the stems of their YAML files (checked by a test).
OUR_TASKS = tuple(sorted(p.stem for p in TASKS_DIR.glob("*.yaml")))

# lm-eval options that gqakit eval sets itself, and the gqakit option that sets each
_RESERVED = {
    "model": "MODEL", "model_args": "MODEL", "tasks": "--tasks", "task_manager": "--tasks",
    "device": "--device", "verbosity": "-v",
    "batch_size": "--batch-size",  # lm-eval reads it only for a model given by name, not a loaded one
}  # fmt: skip
# HFLM arguments that make sense for a model that is already loaded.
_HFLM_KEYS = {
    "max_length", "truncation", "add_bos_token", "prefix_token_id", "max_batch_size", "softmax_dtype",
    "mixed_precision_dtype", "logits_cache", "think_end_token", "enable_thinking", "chat_template_args",
}  # fmt: skip


@dataclass
class LmEvalArgs:
    """``--lm-eval-args``, sorted by where each option goes."""

    # keyword arguments of ``lm_eval.simple_evaluate`` (``num_fewshot``, ``limit``...).
    evaluate: dict[str, Any] = field(default_factory=dict)
    # keyword arguments of ``HFLM`` (``max_length``, ``add_bos_token``...).
    hflm: dict[str, Any] = field(default_factory=dict)
    include_path: list[str] = field(default_factory=list)  # more task directories, after ours.
    # task metadata (``ppl_file``, ``mc_file`` for our tasks; ``max_seq_lengths``...).
    metadata: dict[str, Any] = field(default_factory=dict)


def _value(text: str) -> Any:
    """A command-line value: JSON when it parses (numbers, true/false, {...}), else the string."""
    lowered = {"true": True, "false": False, "none": None, "null": None}
    if text.lower() in lowered:
        return lowered[text.lower()]
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_lm_eval_args(text: str | None, flag: str = "--lm-eval-args") -> LmEvalArgs:
    """Parse ``"--num_fewshot 5 --limit 100"`` or ``"num_fewshot=5,limit=100"`` (either style, dashes or
    underscores; a JSON value quoted as in a shell) into :class:`LmEvalArgs`, rejecting unknown names with
    the known ones."""
    out = LmEvalArgs()
    if not text or not text.strip():
        return out
    try:
        tokens = shlex.split(text if "--" in text or "{" in text else text.replace(",", " "))
    except ValueError as e:  # an unclosed quote
        raise GqakitError(f"{flag}: cannot read {text!r}: {e}.") from None
    # deferred: lm-eval takes seconds to import
    import lm_eval

    known = [p for p in inspect.signature(lm_eval.simple_evaluate).parameters if p not in _RESERVED]
    problems = []
    while tokens:
        tok = tokens.pop(0)
        key, eq, val = tok.lstrip("-").partition("=")
        if not eq and not tok.startswith("--"):
            raise GqakitError(
                f"{flag}: cannot read {tok!r}; write lm-eval's options as `--name value` or `name=value`, "
                f"""a JSON value in quotes (e.g. {flag} "--num_fewshot 5 --metadata '{{...}}'")."""
            )
        if not eq:  # the next token is the value, else a bare flag like --log_samples
            val = tokens.pop(0) if tokens and not tokens[0].startswith("--") else "true"
        key = key.replace("-", "_")
        if key == "include_path":
            out.include_path += [str(Path(p).expanduser().resolve()) for p in val.split(",") if p]
        elif key == "metadata":
            parsed = _value(val)
            if not isinstance(parsed, dict):
                example = """--metadata '{"ppl_file": "test.txt"}'"""
                problems.append(f"metadata must be a JSON object, e.g. {example}, got {val!r}.")
            else:
                out.metadata.update(parsed)
        elif key in _HFLM_KEYS:
            out.hflm[key] = _value(val)
        elif key in known:
            out.evaluate[key] = _value(val)
        elif key in _RESERVED:
            problems.append(f"{key!r} is set by gqakit eval itself: use its {_RESERVED[key]}.")
        else:
            choices = sorted({*known, *_HFLM_KEYS, "include_path", "metadata"})
            problems.append(
                f"{key!r} is not an lm-eval option.{did_you_mean(key, choices)} Known: {', '.join(choices)}."
            )
    if problems:
        raise GqakitError(f"{flag}: " + " ".join(problems))
    return out


# The JSON-safe part of lm-eval's output that a result keeps.
KEEP = ("results", "groups", "versions", "n-shot", "higher_is_better", "n-samples", "config")


@lru_cache(maxsize=4)
def _task_manager(manager_json: str):
    # deferred: lm-eval takes seconds to import
    from lm_eval.tasks import TaskManager

    return TaskManager(**json.loads(manager_json))


def task_manager(tasks: list[str] | tuple[str, ...] = (), args: LmEvalArgs | None = None):
    """lm-eval's TaskManager with our tasks directory and ``args.include_path`` registered; lm-eval's own
    few thousand tasks are indexed, which takes seconds, only when a task outside ours is asked for."""
    args = args or LmEvalArgs()
    manager = {
        "include_path": [str(TASKS_DIR), *args.include_path],
        "include_defaults": bool(args.include_path) or any(t not in OUR_TASKS for t in tasks),
        "metadata": args.metadata,
    }
    return _task_manager(json.dumps(manager, sort_keys=True))


def check_tasks(tasks: list[str] | tuple[str, ...], args: LmEvalArgs | None = None) -> None:
    """Raise a GqakitError naming lm-eval's closest task names for every task it does not know."""
    tm = task_manager(tasks, args)
    unknown = [t for t in tasks if t not in tm.all_tasks and not t.endswith((".yaml", ".yml"))]
    if unknown:
        named = " ".join(f"{t!r}.{did_you_mean(t, tm.all_tasks)}" for t in unknown)
        raise GqakitError(
            f"Unknown lm-eval task(s): {named} Our offline tasks: {', '.join(OUR_TASKS)}. "
            "`lm-eval ls tasks` lists all of lm-eval's."
        )


def run_lm_eval(
    model,
    tokenizer,
    tasks: list[str] | tuple[str, ...],
    *,
    args: LmEvalArgs | str | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Evaluate an already-loaded model on lm-eval ``tasks``.

    Args:
        model: a loaded causal LM (not loaded again).
        tokenizer: its tokenizer.
        tasks: lm-eval task names; ours are ``gqakit_ppl`` and ``gqakit_mc``.
        args: ``--lm-eval-args`` text or parsed :class:`LmEvalArgs`.
        batch_size: lm-eval's batch size.
        max_length: HFLM's ``max_length`` (the rolling window of perplexity tasks); None: the model's.
        seed: lm-eval's random, numpy, torch and few-shot seeds.

    Returns:
        ``{"results": {task: {metric: value}}, "versions": ..., "n-samples": ..., "config": ...}``, the
        JSON-safe part of lm-eval's output.
    """
    # deferred: lm-eval takes seconds to import
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    parsed = args if isinstance(args, LmEvalArgs) else parse_lm_eval_args(args)
    tasks = parse_list(tasks, str, "--tasks")
    check_tasks(tasks, parsed)
    hflm_kwargs = {"batch_size": batch_size, **parsed.hflm}
    if max_length is not None:
        hflm_kwargs.setdefault("max_length", max_length)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, **hflm_kwargs)
    seeds = ("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed")
    kwargs = {**dict.fromkeys(seeds, seed), "log_samples": False, **parsed.evaluate}
    try:
        out = lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), task_manager=task_manager(tasks, parsed), **kwargs
        )
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as e:
        raise GqakitError(
            f"lm-eval could not run {', '.join(tasks)}: {type(e).__name__}: {e}. Tasks whose data lives on "
            f"the hub need a network connection; {', '.join(OUR_TASKS)} run offline."
        ) from None
    if out is None:  # non-zero rank in a distributed run
        return {}
    return json.loads(json.dumps({k: out[k] for k in KEEP if k in out}, default=str))
