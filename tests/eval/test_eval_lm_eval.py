"""lm-eval bridge: our offline tasks from any directory, agreement with our perplexity, plain lm-eval on a
converted checkpoint, option pass-through and unknown task names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gqakit.errors import GqakitError
from gqakit.eval.lm_eval_bridge import OUR_TASKS, TASKS_DIR, parse_lm_eval_args, run_lm_eval
from gqakit.eval.perplexity import perplexity
from gqakit.text import load_texts


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def test_every_task_yaml_parses_and_is_named_after_its_file():
    assert set(OUR_TASKS) == {"gqakit_ppl", "gqakit_mc"}
    for name in OUR_TASKS:
        cfg = yaml.load((TASKS_DIR / f"{name}.yaml").read_text(), Loader=_Loader)
        assert cfg["task"] == name
        assert cfg["custom_dataset"].startswith("local_data.")
    for data in ("gqakit_ppl.txt", "gqakit_mc.jsonl"):
        assert (TASKS_DIR / data).is_file()


def test_ppl_task_from_another_directory_equals_our_perplexity(loaded_mha, tmp_path, monkeypatch):
    model, tok = loaded_mha
    monkeypatch.chdir(tmp_path)  # nothing may be found relative to the working directory
    out = run_lm_eval(model, tok, ["gqakit_ppl"], batch_size=4, max_length=64)
    bpb = out["results"]["gqakit_ppl"]["bits_per_byte,none"]
    ours = perplexity(model, tok, load_texts(TASKS_DIR / "gqakit_ppl.txt"), seq_len=64, progress=False)
    assert bpb == pytest.approx(ours.bits_per_byte, rel=1e-5)
    assert 0 < bpb < 100


def test_ppl_task_on_a_relative_jsonl_via_metadata(loaded_mha, tmp_path, monkeypatch, known_text):
    model, tok = loaded_mha
    monkeypatch.chdir(tmp_path)
    rows = [{"body": known_text[:120]}, {"body": known_text[120:]}]
    Path("mine.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = run_lm_eval(
        model,
        tok,
        "gqakit_ppl",
        batch_size=2,
        max_length=32,
        args='--metadata \'{"ppl_file": "mine.jsonl", "ppl_text_field": "body"}\'',
    )
    ours = perplexity(model, tok, load_texts("mine.jsonl", text_field="body"), seq_len=32, progress=False)
    assert out["results"]["gqakit_ppl"]["bits_per_byte,none"] == pytest.approx(ours.bits_per_byte, rel=1e-5)


def test_multiple_choice_task_runs_with_pass_through_options(loaded_mha, tmp_path, monkeypatch):
    model, tok = loaded_mha
    monkeypatch.chdir(tmp_path)
    out = run_lm_eval(model, tok, ["gqakit_mc"], batch_size=8, args="--limit 6 --num_fewshot 1")
    res = out["results"]["gqakit_mc"]
    assert 0.0 <= res["acc,none"] <= 1.0
    assert out["n-samples"]["gqakit_mc"]["effective"] == 6
    assert out["n-shot"]["gqakit_mc"] == 1


def test_unknown_task_lists_lm_evals_closest_names(loaded_mha):
    model, tok = loaded_mha
    with pytest.raises(GqakitError) as err:
        run_lm_eval(model, tok, ["helaswag", "gqakit_pl"])
    msg = err.value.message
    assert "'helaswag'. Did you mean \"hellaswag\"?" in msg
    assert "gqakit_ppl" in msg


def test_plain_lm_eval_hf_model_on_a_converted_checkpoint(tiny_models, tmp_path, monkeypatch):
    """What `lm-eval --model hf --model_args pretrained=DST --include_path TASKS_DIR` does, in-process."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(tmp_path)
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tiny_models['mqa']},max_length=64",
        device="cpu",
        tasks=["gqakit_ppl", "gqakit_mc"],
        batch_size=4,
        log_samples=False,
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
    )
    assert 0 < out["results"]["gqakit_ppl"]["bits_per_byte,none"] < 100
    assert 0 <= out["results"]["gqakit_mc"]["acc,none"] <= 1


@pytest.mark.slow
def test_plain_lm_eval_command_line(tiny_models, tmp_path):
    """The README's command, as a subprocess from another directory."""
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={tiny_models['gqa']},max_length=64",
        "--device",
        "cpu",
        "--include_path",
        str(TASKS_DIR),
        "--tasks",
        "gqakit_ppl,gqakit_mc",
        "--batch_size",
        "4",
        "--output_path",
        str(tmp_path / "out"),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "gqakit_ppl" in run.stdout and "bits_per_byte" in run.stdout


def test_parse_lm_eval_args_both_styles():
    a = parse_lm_eval_args(
        '--num_fewshot 5 --limit 0.5 --max_length 128 --metadata \'{"mc_file": "q.jsonl"}\''
    )
    assert a.evaluate == {"num_fewshot": 5, "limit": 0.5}
    assert a.hflm == {"max_length": 128}
    assert a.metadata == {"mc_file": "q.jsonl"}
    b = parse_lm_eval_args("num-fewshot=3,apply_chat_template=false")
    assert b.evaluate == {"num_fewshot": 3, "apply_chat_template": False}
    assert parse_lm_eval_args("").evaluate == {}


@pytest.mark.parametrize(
    "text, message",
    [
        ("--num_fewshots 5", "'num_fewshots' is not an lm-eval option. Did you mean \"num_fewshot\"?"),
        ("--tasks x", "'tasks' is set by gqakit eval itself: use its --tasks."),
        # lm-eval would record it and ignore it for a loaded model: gqakit's own option sets it
        ("--batch_size 2", "'batch_size' is set by gqakit eval itself: use its --batch-size."),
        ("--metadata 3", "metadata must be a JSON object"),
        ("fewshot", "cannot read 'fewshot'"),
        # JSON needs the shell's quotes around it, as on lm-eval's command line
        ('--metadata {"ppl_file": "x.txt"}', "a JSON value in quotes"),
        ("--num_fewshot '5", "No closing quotation"),  # a message, not shlex's traceback
    ],
)
def test_parse_lm_eval_args_errors(text, message):
    with pytest.raises(GqakitError, match=message.replace("(", r"\(").replace("?", r"\?")):
        parse_lm_eval_args(text)
