"""The transformers engine of ``gqakit eval``: load one checkpoint in this process, measure it, free it.

:func:`gqakit.eval.api.evaluate_models` owns everything that spans models (checks before any weights
load, baseline and order, environment); it hands each model to :func:`measure_hf_model`, which fills
one :class:`~gqakit.eval.results.ModelResult` with what the options ask for:

* perplexity (:func:`gqakit.eval.perplexity.perplexity`) over the texts ``evaluate_models`` loaded once;
* lm-eval tasks on the loaded model (:func:`gqakit.eval.lm_eval_bridge.run_lm_eval`);
* the decode grid (:func:`gqakit.eval.decode.bench_decode`) over the contexts that fit the model.

Another engine measures a model its own way and returns the same ``ModelResult``; the orchestration
and the report need nothing else from it.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import torch

from gqakit.eval.decode import bench_decode
from gqakit.eval.kv_bytes import cache_geometry, config_geometry, dtype_bytes, weight_bytes_per_step
from gqakit.eval.lm_eval_bridge import parse_lm_eval_args, run_lm_eval
from gqakit.eval.options import EvalOptions
from gqakit.eval.perplexity import perplexity
from gqakit.eval.results import ModelResult
from gqakit.models import load_causal_lm, load_tokenizer, resolve_device

log = logging.getLogger(__name__)


def measure_hf_model(
    label: str,
    path: str,
    *,
    config: Any,
    options: EvalOptions,
    texts: list[str] | None,
    contexts: list[int],
) -> ModelResult:
    """Load ``path`` with transformers, measure what ``options`` ask for, and free the model again.

    Args:
        label: the model's name in tables and plots.
        path: checkpoint directory or hub id.
        config: its transformers config, already checked by ``evaluate_models``.
        options: what to measure; ``options.seed`` seeds torch before loading.
        texts: the perplexity texts; None: no perplexity.
        contexts: the decode contexts for this model (used when ``options.bench``).

    Returns:
        The model's :class:`~gqakit.eval.results.ModelResult`.
    """
    log.info("[%s] loading %s", label, path)
    torch.manual_seed(options.seed)
    start = time.perf_counter()
    model = load_causal_lm(path, dtype=options.dtype, device=options.device)
    tokenizer = load_tokenizer(path) if (texts is not None or options.tasks) else None
    load_s = time.perf_counter() - start
    dtype = next(model.parameters()).dtype
    res = ModelResult.of(
        label, path, config_geometry(config), parameters=sum(p.numel() for p in model.parameters()),
        dtype=str(dtype).removeprefix("torch."), kv_dtype_bytes=dtype_bytes(dtype),
        weight_bytes=weight_bytes_per_step(model), load_s=load_s,
        cached=cache_geometry(config),  # the heads transformers caches (Falcon's new layout: H)
    )  # fmt: skip
    if texts is not None:
        res.perplexity = perplexity(
            model,
            tokenizer,
            texts,
            seq_len=options.seq_len,
            stride=options.stride,
            batch_size=options.batch_size,
            max_tokens=options.max_tokens,
            progress=options.progress,
        )
        log.info(
            "[%s] perplexity %.4f, %.4f bits/byte over %d tokens",
            label,
            res.perplexity.ppl,
            res.perplexity.bits_per_byte,
            res.perplexity.tokens,
        )
    if options.tasks:
        res.lm_eval = run_lm_eval(
            model,
            tokenizer,
            options.tasks,
            args=parse_lm_eval_args(options.lm_eval_args),
            batch_size=options.batch_size,
            max_length=options.seq_len,
            seed=options.seed,
        )
    if options.bench:
        res.decode = bench_decode(
            model,
            batch_sizes=options.batch_sizes,
            contexts=contexts,
            new_tokens=options.new_tokens,
            warmup=options.warmup,
            static_cache=options.static_cache,
            compile=options.compile,
            progress=options.progress,
            seed=options.seed,
        )
    # Free the weights before the next model loads, so the peak memory is one model's.
    del model, tokenizer
    gc.collect()
    if resolve_device(options.device).type == "cuda":
        torch.cuda.empty_cache()
    return res


__all__ = ["measure_hf_model"]
