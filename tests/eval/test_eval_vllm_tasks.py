"""``gqakit eval --engine vllm --tasks``: lm-eval's vLLM model in vLLM's Python. The messages for a Python
without lm-eval and for lm-eval's own failures run anywhere; the agreement with ``--engine hf`` needs
vLLM (marked slow, skipped without it)."""

from __future__ import annotations

import math
import sys

import pytest
from vllm_helpers import needs_vllm

from gqakit.errors import GqakitError
from gqakit.eval import EvalOptions, evaluate_models
from gqakit.eval.lm_eval_bridge import LmEvalArgs
from gqakit.eval.vllm_engine import run_vllm_lm_eval
from gqakit.testing import TINY_TEXT, save_tiny_model


def _run(python: str, path: str = "unused") -> dict:
    return run_vllm_lm_eval(
        python, path, ("gqakit_ppl",), args=LmEvalArgs(), dtype="float32", max_length=32, seed=0,
        batch_size=1, kv_budget_gib=1,
    )  # fmt: skip


def test_a_vllm_python_without_lm_eval_gets_the_install_command(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'lm_eval'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(GqakitError) as err:
        _run(str(fake))
    assert f'{fake} -m pip install "lm-eval>=0.4.10"' in err.value.message


def test_lm_evals_own_failure_is_one_line(tmp_path):
    # this Python has lm-eval but no vLLM: lm-eval's vllm model type refuses, and we say so in one line
    with pytest.raises(GqakitError) as err:
        _run(sys.executable, str(save_tiny_model(tmp_path / "m", "llama")))
    message = err.value.message
    assert message.startswith("lm-eval in vLLM could not run gqakit_ppl: ") and "\n" not in message
    assert "vllm" in message.lower()


@pytest.mark.slow
@needs_vllm
def test_tasks_in_vllm_agree_with_transformers(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TINY_TEXT * 3)
    model = save_tiny_model(tmp_path / "m", "llama", heads=4, kv_heads=2, hidden=128)  # head_dim 32
    args = f'--metadata \'{{"ppl_file": "{text}"}}\''
    opts = dict(tasks="gqakit_ppl,gqakit_mc", lm_eval_args=args, seq_len=64, dtype="float32", progress=False)
    hf = evaluate_models({"m": str(model)}, EvalOptions(**opts)).models["m"].lm_eval["results"]
    vl = evaluate_models({"m": str(model)}, EvalOptions(**opts, engine="vllm")).models["m"].lm_eval["results"]
    bpb = "bits_per_byte,none"
    assert math.isclose(hf["gqakit_ppl"][bpb], vl["gqakit_ppl"][bpb], rel_tol=1e-3)
    assert hf["gqakit_mc"]["acc,none"] == vl["gqakit_mc"]["acc,none"]
