"""Evaluation: perplexity, lm-eval tasks, decode speed and KV-cache memory, before vs after conversion."""

from gqakit.eval.api import evaluate, evaluate_models
from gqakit.eval.decode import DecodePoint, bench_decode
from gqakit.eval.lm_eval_bridge import TASKS_DIR, run_lm_eval
from gqakit.eval.options import EvalOptions
from gqakit.eval.perplexity import PerplexityResult, perplexity
from gqakit.eval.report import write_report
from gqakit.eval.results import EvalResults, ModelResult

__all__ = [
    "TASKS_DIR",
    "DecodePoint",
    "EvalOptions",
    "EvalResults",
    "ModelResult",
    "PerplexityResult",
    "bench_decode",
    "evaluate",
    "evaluate_models",
    "perplexity",
    "run_lm_eval",
    "write_report",
]
