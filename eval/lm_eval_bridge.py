"""Run lm-eval tasks on a model that is already loaded: wrap, never fork.

The model goes to ``lm_eval.simple_evaluate`` inside ``lm_eval.models.huggingface.HFLM(pretrained=model,
tokenizer=tokenizer)``, so it is not loaded a second time. Our offline tasks (``eval/tasks/*.yaml``, in
lm-eval's own YAML format) are registered the way ``lm-eval --include_path`` registers a directory, with
lm-eval's ``TaskManager(include_path=TASKS_DIR)``; every lm-eval task name works too when its data is
reachable.

Plain lm-eval works on a converted checkpoint with the same tasks::

    lm-eval --model hf --model_args pretrained=./smollm2-mqa \\
        --include_path "$(python -c 'import gqakit.eval as e; print(e.TASKS_DIR)')" \\
        --tasks gqakit_ppl,gqakit_mc
"""

from __future__ import annotations

import difflib
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
    """``--lm-eval-args``, sorted by where each option goes.

    Attributes:
        evaluate: keyword arguments of ``lm_eval.simple_evaluate`` (``num_fewshot``, ``limit``...).
        hflm: keyword arguments of ``HFLM`` (``max_length``, ``add_bos_token``...).
        include_path: more task directories, after ours.
        metadata: task metadata (``ppl_file``, ``mc_file`` for our tasks; ``max_seq_lengths``...).
    """

    evaluate: dict[str, Any] = field(default_factory=dict)
    hflm: dict[str, Any] = field(default_factory=dict)
    include_path: list[str] = field(default_factory=list)
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


def _evaluate_params() -> list[str]:
    # deferred: lm-eval takes seconds to import
    import lm_eval

    return list(inspect.signature(lm_eval.simple_evaluate).parameters)


def _protect_json(text: str) -> tuple[str, list[str]]:
    """``text`` with each JSON object in it (``{...}``, nested ones included) replaced by a placeholder, and
    the objects in order: shell splitting would strip the quotes inside ``--metadata {"ppl_file": "x.txt"}``
    and leave no JSON. Braces that open no JSON object are left to the parser, which names what it cannot
    read."""
    out, objects, at = [], [], 0
    for start in [i for i, ch in enumerate(text) if ch == "{"]:
        if start < at:  # inside an object already taken
            continue
        try:
            end = json.JSONDecoder().raw_decode(text, start)[1]
        except ValueError:
            continue
        out += [text[at:start], f"\x00{len(objects)}\x00"]
        objects.append(text[start:end])
        at = end
    return "".join(out) + text[at:], objects


def _restore_json(token: str, objects: list[str]) -> str:
    for n, obj in enumerate(objects):
        token = token.replace(f"\x00{n}\x00", obj)
    return token


def parse_lm_eval_args(text: str | None, flag: str = "--lm-eval-args") -> LmEvalArgs:
    """Parse ``"--num_fewshot 5 --limit 100"`` or ``"num_fewshot=5,limit=100"`` (either style, dashes or
    underscores) into :class:`LmEvalArgs`, rejecting unknown names with the known ones."""
    out = LmEvalArgs()
    if not text or not text.strip():
        return out
    text, objects = _protect_json(text)
    tokens = shlex.split(text.replace(",", " ") if "--" not in text and "{" not in text else text)
    tokens = [_restore_json(t, objects) for t in tokens]
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        key, eq, val = tok.lstrip("-").partition("=")
        if not eq:
            if tok.startswith("--") and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                val = tokens[i + 1]
                i += 1
            elif tok.startswith("--"):
                val = "true"  # a bare flag, like --log_samples
            else:
                raise GqakitError(
                    f"{flag}: cannot read {tok!r}; write lm-eval's options as `--name value` or `name=value` "
                    f'(e.g. {flag} "--num_fewshot 5 --limit 100").'
                )
        pairs.append((key.replace("-", "_"), val))
        i += 1

    known = [p for p in _evaluate_params() if p not in _RESERVED]
    problems = []
    for key, val in pairs:
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


def split_tasks(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """``"hellaswag, arc_easy"`` -> ("hellaswag", "arc_easy")."""
    return () if value is None else parse_list(value, str, "--tasks")


def check_tasks(tasks: list[str] | tuple[str, ...], args: LmEvalArgs | None = None) -> None:
    """Raise a GqakitError naming lm-eval's closest task names for every task it does not know."""
    tm = task_manager(tasks, args)
    known = set(tm.all_tasks)
    unknown = [t for t in tasks if t not in known and not t.endswith((".yaml", ".yml"))]
    if unknown:
        lines = []
        for t in unknown:
            close = difflib.get_close_matches(t, tm.all_tasks, n=5, cutoff=0.6)
            hint = f" closest: {', '.join(close)}" if close else " (nothing close)"
            lines.append(f"{t!r}{';' if close else ''}{hint}")
        raise GqakitError(
            f"Unknown lm-eval task(s): {'; '.join(lines)}. Our offline tasks: {', '.join(OUR_TASKS)}. "
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
    tasks = split_tasks(tasks)
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
    except GqakitError:
        raise
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as e:
        raise GqakitError(
            f"lm-eval could not run {', '.join(tasks)}: {type(e).__name__}: {e}. Tasks whose data lives on "
            f"the hub need a network connection; {', '.join(OUR_TASKS)} run offline."
        ) from None
    if out is None:  # non-zero rank in a distributed run
        return {}
    return json.loads(json.dumps({k: out[k] for k in KEEP if k in out}, default=str))
