"""Evaluation: perplexity, lm-eval tasks, decode speed and KV-cache memory, before vs after conversion."""

from gqakit.eval.api import evaluate, evaluate_models
from gqakit.eval.decode import DecodePoint, bench_decode
from gqakit.eval.kv_bytes import (
    bytes_moved_per_step,
    measured_kv_bytes,
    predicted_kv_bytes,
    speedup_bound,
    weight_bytes_per_step,
)
from gqakit.eval.lm_eval_bridge import OUR_TASKS, TASKS_DIR, parse_lm_eval_args, run_lm_eval
from gqakit.eval.options import DEFAULT_BATCH_SIZES, DEFAULT_CONTEXTS, EvalOptions
from gqakit.eval.perplexity import PerplexityResult, perplexity, sliding_windows
from gqakit.eval.report import write_report
from gqakit.eval.results import EvalResults, ModelResult
from gqakit.text import DOC_SEPARATOR, load_texts

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_CONTEXTS",
    "DOC_SEPARATOR",
    "OUR_TASKS",
    "TASKS_DIR",
    "DecodePoint",
    "EvalOptions",
    "EvalResults",
    "ModelResult",
    "PerplexityResult",
    "bench_decode",
    "bytes_moved_per_step",
    "evaluate",
    "evaluate_models",
    "load_texts",
    "measured_kv_bytes",
    "parse_lm_eval_args",
    "perplexity",
    "predicted_kv_bytes",
    "run_lm_eval",
    "sliding_windows",
    "speedup_bound",
    "weight_bytes_per_step",
    "write_report",
]
