"""The transformers engine of ``gqakit eval``: load one checkpoint in this process, measure what the
options ask for (perplexity, lm-eval tasks on the loaded model, the decode grid), and free it again."""

from __future__ import annotations

import time
from typing import Any

import torch

from gqakit.dtypes import dtype_name
from gqakit.eval.decode import bench_decode, free_memory
from gqakit.eval.kv_bytes import cache_geometry, config_geometry, weight_bytes_per_step
from gqakit.eval.lm_eval_bridge import parse_lm_eval_args, run_lm_eval
from gqakit.eval.options import EvalOptions
from gqakit.eval.perplexity import perplexity
from gqakit.eval.results import ModelResult
from gqakit.models import load_causal_lm, load_tokenizer


def measure_hf_model(
    label: str, path: str, *, config: Any, options: EvalOptions, texts: list[str] | None, contexts: list[int]
) -> ModelResult:
    """Measure ``path`` with transformers (the arguments: :class:`~gqakit.eval.engines.Engine`)."""
    torch.manual_seed(options.seed)
    start = time.perf_counter()
    model = load_causal_lm(path, dtype=options.dtype, device=options.device)
    tokenizer = load_tokenizer(path) if (texts is not None or options.tasks) else None
    dtype = next(model.parameters()).dtype
    res = ModelResult.of(
        label, path, config_geometry(config), parameters=sum(p.numel() for p in model.parameters()),
        dtype=dtype_name(dtype), kv_dtype_bytes=dtype.itemsize,
        weight_bytes=weight_bytes_per_step(model), load_s=time.perf_counter() - start,
        cached=cache_geometry(config),  # the heads transformers caches (Falcon's new layout: H)
    )  # fmt: skip
    if texts is not None:
        res.perplexity = perplexity(
            model, tokenizer, texts, seq_len=options.seq_len, stride=options.stride,
            batch_size=options.batch_size, max_tokens=options.max_tokens, progress=options.progress,
        )  # fmt: skip
    if options.tasks:
        res.lm_eval = run_lm_eval(
            model, tokenizer, options.tasks, args=parse_lm_eval_args(options.lm_eval_args),
            batch_size=options.batch_size, max_length=options.seq_len, seed=options.seed,
        )  # fmt: skip
    if options.bench:
        res.decode = bench_decode(
            model, batch_sizes=options.batch_sizes, contexts=contexts, new_tokens=options.new_tokens,
            warmup=options.warmup, static_cache=options.static_cache, progress=options.progress,
            seed=options.seed,
        )  # fmt: skip
    # Free the weights before the next model loads, so the peak memory is one model's.
    del model, tokenizer
    free_memory(options.device)
    return res
