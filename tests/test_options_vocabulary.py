"""The options vocabulary: every command's problem messages name only flags that command has, the shared
options mean the same everywhere, and the name tables answer unknown names with the choices."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from gqakit.cli import COMMANDS, load_command, main
from gqakit.cli_options import parse_list
from gqakit.convert.methods import METHODS, PAPER_METHODS, POOLING_METHODS
from gqakit.convert.options import PRESETS, ConvertOptions, check_groups
from gqakit.errors import GqakitError
from gqakit.eval.engines import ENGINES
from gqakit.eval.options import EvalOptions
from gqakit.geometry import AttentionGeometry
from gqakit.names import NameTable
from gqakit.pipelines.demo.options import DemoOptions
from gqakit.pipelines.probe.options import ProbeOptions
from gqakit.pipelines.replicate.options import ReplicateOptions
from gqakit.pipelines.starts import STARTS as ARMS
from gqakit.problems import Problems, check_options, command_flags

# A flag as a message names it: ``--seq-len``, not the ``--num`` of lm-eval's ``--num_fewshot``.
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w])")


def all_flags(command: click.Command) -> set[str]:
    """Every spelling the command accepts (visible or not), so a message may name any of them."""
    return {
        o for p in command.params for o in (*p.opts, *getattr(p, "secondary_opts", ())) if o.startswith("--")
    }


def foreign_flags(message: str, command: click.Command) -> list[str]:
    """The flags ``message`` names that ``command`` does not have; quoted text (another tool's options
    given as an example value, ``"--num_fewshot 5 --limit 100"``) is a value, not a flag."""
    unquoted = re.sub(r'"[^"]*"|`[^`]*`', "", message)
    return sorted(set(FLAG.findall(unquoted)) - all_flags(command))


def _bad_value(type_name: str, number: float) -> object:
    """A wrong value for a field of this annotated type, or MISSING where there is none to give."""
    base = type_name.replace(" | None", "")
    if base in ("int", "float"):
        return number
    if base == "str":
        return "bogus"
    if base in ("tuple[int, ...]", "tuple[float, ...]"):
        return (number,)
    if base.startswith("tuple[str"):
        return ("bogus",)
    return MISSING


def bad_settings(cls: type, number: float) -> dict[str, object]:
    """Every numeric field set to ``number`` and every name to ``bogus``; the paths made to collide."""
    settings = {}
    for f in fields(cls):
        value = _bad_value(str(f.type), number)
        if value is not MISSING and f.name != "command_line":
            settings[f.name] = value
    if {"work_dir", "out"} <= {f.name for f in fields(cls)}:
        settings["work_dir"] = settings["out"] = Path("same")
    return settings


def problems_of(cls: type, settings: dict[str, object], home: str = "") -> str:
    """The message the options report (construction checks some, ``check_options`` the others, naming
    the flags of the command ``home`` outside a command, as a typed entry point does)."""
    with pytest.raises(GqakitError) as e:
        check_options(cls(**settings), home)
    return e.value.message


# command -> the option classes its run builds (the demo converts and evaluates with its own settings)
USES = [
    ("convert", ConvertOptions),
    ("eval", EvalOptions),
    ("probe", ProbeOptions),
    ("demo", DemoOptions),
    ("demo", EvalOptions),
    ("demo", ConvertOptions),
    ("replicate", ReplicateOptions),
    ("replicate", ConvertOptions),
    ("uptrain", ConvertOptions),
]


@pytest.mark.parametrize("number", [0, -1])
@pytest.mark.parametrize(("name", "cls"), USES, ids=[f"{n}-{c.__name__}" for n, c in USES])
def test_every_problem_names_only_flags_the_running_command_has(name, cls, number):
    command = load_command(name)
    with click.Context(command):
        message = problems_of(cls, bad_settings(cls, number))
    assert message
    assert not foreign_flags(message, command), f"gqakit {name}: {message}"


@pytest.mark.parametrize("name", ["convert", "probe", "demo", "replicate", "uptrain"])
def test_the_group_checks_name_only_flags_the_running_command_has(name):
    command = load_command(name)
    geom = AttentionGeometry("llama", num_layers=1, hidden_size=32, num_heads=8, num_kv_heads=4, head_dim=4)
    for groups in (0, 3, 8):
        with click.Context(command), pytest.raises(GqakitError) as e:
            check_groups(geom, groups)
        assert not foreign_flags(e.value.message, command), e.value.message


def test_from_python_the_options_name_their_own_commands_flags():
    demo = problems_of(
        DemoOptions, {"seq_len": 0, "budget_scale": 0, "out": Path("x"), "work_dir": Path("x")}, "demo"
    )
    assert "seq_len must be at least 1" in demo and "--seq-len" not in demo  # gqakit demo has no --seq-len
    assert "--budget-scale must be positive" in demo and "--work-dir and --out must differ" in demo
    probe = problems_of(ProbeOptions, {"groups": (1,), "eval_data": "x", "methods": ("meen",)}, "probe")
    assert "--methods meen: unknown conversion method; choose from mean, first" in probe
    assert 'calibrated. Did you mean "mean"?' in probe


def test_the_demo_reports_its_options_with_its_own_flags(tmp_path):
    same = str(tmp_path / "same")
    res = CliRunner().invoke(main, ["demo", "--work-dir", same, "--out", same, "--decode-rounds", "0"])
    assert res.exit_code == 2
    assert (
        "--decode-rounds must be at least 1, got 0." in res.output
        and "--work-dir and --out must differ." in res.output
    )
    assert not foreign_flags(res.output, load_command("demo"))


def test_the_checker_catches_a_flag_the_command_lacks():
    command = click.Command("x", params=[click.Option(["--out"]), click.Option(["--progress/--no-progress"])])
    assert foreign_flags("--out and --no-progress; lm-eval's --num_fewshot", command) == []
    assert foreign_flags('e.g. "--limit 100" or `--name value`', command) == []
    assert foreign_flags("--seq-len must be positive", command) == ["--seq-len"]
    assert command_flags(command) == {"out": "--out", "progress": "--progress"}


def test_every_output_folder_is_out_and_shared_options_read_the_same():
    helps: dict[str, set[str]] = {}
    for name in COMMANDS:
        command = load_command(name)
        subcommands = command.commands.values() if isinstance(command, click.Group) else [command]
        for sub in subcommands:
            for p in sub.params:
                if isinstance(p, click.Option) and not p.hidden:
                    assert p.opts[0] not in ("--report-dir", "--out-dir", "--output"), (name, p.opts)
                    helps.setdefault(p.opts[0], set()).add(p.help or "")
    for flag in ("--device", "--progress", "--cache-dir", "--wheelhouse", "--work-dir", "--fresh"):
        assert len(helps[flag]) == 1, (flag, helps[flag])


def test_comma_lists_parse_one_way_everywhere():
    assert parse_list("1, 8,32", int, "--groups") == (1, 8, 32)
    assert parse_list((0.5, "1"), float, "--alphas") == (0.5, 1.0)
    with pytest.raises(GqakitError, match="--alphas 'a,b' is not a comma-separated list of float values"):
        parse_list("a,b", float, "--alphas")
    for text in ("0,0.05,inf", "nan", "0,-inf"):  # float() reads them; no list option means them
        with pytest.raises(GqakitError, match=rf"--alphas '{text}': .* is not a finite number"):
            parse_list(text, float, "--alphas")
    res = CliRunner().invoke(main, ["probe", "m", "--eval-data", "x", "--groups", "1,two"])
    assert res.exit_code == 2 and "'--groups'" in res.output and "comma-separated list of int" in res.output


def test_the_name_tables_say_what_each_name_is_and_suggest_the_closest():
    assert re.match(
        "--method 'calibrate' is unknown; .* Did you mean \"calibrated\"",
        METHODS.unknown("calibrate", "--method"),
    )
    assert (
        ENGINES.unknown("hff", "--engine")
        == "--engine 'hff' is unknown; choose one of hf, llamacpp, vllm. Did you mean \"hf\"?"
    )
    assert METHODS.names == ("mean", "first", "random", "calibrated")
    assert POOLING_METHODS == PAPER_METHODS == ("mean", "first", "random")
    assert ARMS.names == (*PRESETS.names, "first", "random", "calibrated")  # starts: presets, then methods
    table = NameTable("colour", {"red": "warm", "blue": "cold"})
    assert table.describe() == "red: warm; blue: cold" and table.where(lambda e: e == "cold") == ("blue",)


def test_the_choices_and_the_recipe_checks_read_the_tables():
    convert = {p.name: p for p in load_command("convert").params}
    assert tuple(convert["method"].type.choices) == METHODS.names
    assert tuple(convert["preset"].type.choices) == PRESETS.names
    assert tuple({p.name: p for p in load_command("eval").params}["engine"].type.choices) == ENGINES.names
    from gqakit.uptrain.recipe import recipe_from_dict

    with pytest.raises(GqakitError, match="model.convert.method 'calibratd' is unknown; .*\"calibrated\""):
        recipe_from_dict(
            {
                "model": {"path": "m", "convert": {"groups": 1, "method": "calibratd"}},
                "data": {"files": ["x.txt"]},
                "budget": {"steps": 1},
                "output_dir": "o",
            }
        )


def test_problems_outside_any_command_use_the_home_commands_flags():
    p = Problems("eval")
    assert p.flag("batch_sizes") == "--batch-sizes" and p.flag("new_tokens") == "--new-tokens"
    assert p.flag("command_line") == "command_line"  # not a flag of gqakit eval
    assert not p
    p.add(None)
    p.add("one.")
    p.add("two.")
    with pytest.raises(GqakitError, match="^one. two.$"):
        p.raise_if_any()


@pytest.mark.parametrize(
    ("doc", "flag", "table"),
    [
        ("convert.md", "--method", METHODS),
        ("eval.md", "--engine", ENGINES),
    ],
)
def test_the_docs_list_each_table_as_the_help_does(doc, flag, table):
    text = (Path(__file__).resolve().parents[1] / "docs" / doc).read_text()
    rows = [f"| `{flag}` | what it does |", *(f"| `{n}` | {e.summary} |" for n, e in table.items())]
    missing = [r for r in rows if r not in text]
    assert not missing, (
        f"docs/{doc} lacks these rows of its {flag} table (copy them from the table):\n" + "\n".join(missing)
    )
