"""The vLLM engine of ``gqakit eval --engine vllm``: a checkpoint served as GPU users deploy it.

vLLM's paged KV cache stores each K/V head once, so a model with G K/V heads holds H/G times the tokens of
its MHA original in the same memory. Each checkpoint directory is loaded as it is (no export) in a vLLM
worker process (:mod:`gqakit.eval.vllm_client`), and this engine fills the same
:class:`~gqakit.eval.results.ModelResult` as the others, plus its
:class:`~gqakit.eval.serving.ServingResult`:

* perplexity over exactly the transformers engine's windows (:func:`~gqakit.eval.perplexity.encode_stream`,
  :func:`~gqakit.eval.perplexity.sliding_windows`): each window's token ids go to vLLM as a prompt, and its
  prompt log-probabilities score the window's last ``scored`` tokens;
* greedy continuations of :data:`PROMPTS`, compared token by token with transformers' on the same
  checkpoint (loaded here first, and freed before vLLM starts);
* the KV-cache capacity vLLM allocated for ``--kv-budget`` GiB (CPU) and the sequences of ``--seq-len``
  tokens it holds at once;
* with ``--bench``: output tokens/s at each concurrency (``--batch-sizes``) and prompt length
  (``--contexts``), ``--new-tokens`` tokens per sequence, ``--rounds`` rounds interleaved across the points
  (:func:`~gqakit.eval.decode_rounds.interleaved`), the median with its spread and reliability
  (:func:`~gqakit.eval.decode_rounds.round_stats`).
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any

import torch

from gqakit.checkpoint import read_config
from gqakit.errors import GqakitError
from gqakit.eval.decode import DecodePoint
from gqakit.eval.decode_rounds import interleaved, round_stats
from gqakit.eval.kv_bytes import dtype_bytes, weight_bytes_per_step
from gqakit.eval.lm_eval_bridge import parse_lm_eval_args
from gqakit.eval.options import EvalOptions
from gqakit.eval.perplexity import PerplexityResult, encode_stream, prefix_token_id, sliding_windows
from gqakit.eval.results import ModelResult
from gqakit.eval.serving import GreedyAgreement, ServingResult
from gqakit.eval.vllm_client import VllmWorker, check_cpu, vllm_python
from gqakit.eval.vllm_tasks import run_vllm_lm_eval
from gqakit.geometry import AttentionGeometry
from gqakit.models import load_causal_lm, load_tokenizer, max_positions, resolve_device

log = logging.getLogger(__name__)

# The fixed prompts of the greedy comparison: plain prose, each a different kind of continuation.
PROMPTS = (
    "The capital of France is",
    "Grouped-query attention lets several query heads share",
    "Once upon a time, in a village by the sea,",
    "def fibonacci(n):",
)
WINDOWS_PER_REQUEST = 64  # perplexity windows sent to the worker at once


def require_vllm(options: EvalOptions | None = None) -> str:
    """The Python that runs vLLM (see :func:`~gqakit.eval.vllm_client.vllm_python`), after checking the
    CPU can run it; one message with the install commands when there is none."""
    if options is None or resolve_device(options.device).type == "cpu":
        check_cpu()
    return vllm_python(options.vllm_python if options else None)


def _dtype(options: EvalOptions, config: Any) -> str:
    """The dtype to ask vLLM for: ``auto`` means the checkpoint's (vLLM's own ``auto`` would run a float32
    checkpoint in half precision)."""
    if options.dtype != "auto":
        return options.dtype
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    return str(dtype).removeprefix("torch.")


@torch.inference_mode()
def _reference_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, ``new_tokens`` tokens (EOS does not stop it).

    The whole sequence is run again for every token, without a KV cache: the prompts are short, and the
    cache's API differs between the transformers versions gqakit and vLLM's pins allow."""
    device = next(model.parameters()).device
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        for _ in range(new_tokens):
            nxt = model(ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        out.append(ids[0, len(prompt) :].tolist())
    return out


def vllm_perplexity(
    worker: VllmWorker, tokenizer, texts: list[str], options: EvalOptions
) -> PerplexityResult:
    """Perplexity and bits per byte through vLLM's prompt log-probabilities, over the transformers engine's
    windows."""
    stride = options.stride or options.seq_len
    stream, n_bytes = encode_stream(tokenizer, texts, options.max_tokens)
    windows = sliding_windows(len(stream), options.seq_len, stride)
    start, nll_sum = time.perf_counter(), 0.0
    for i in range(0, len(windows), WINDOWS_PER_REQUEST):
        group = windows[i : i + WINDOWS_PER_REQUEST]
        # A window's inputs stream[start:end] predict stream[start+1:end+1]: vLLM scores each prompt token
        # given the ones before it, so the prompt is stream[start:end+1] and its last ``scored`` count.
        reply = worker.request(
            "nll", windows=[stream[w.start : w.end + 1] for w in group], scored=[w.scored for w in group]
        )
        nll_sum += sum(reply["nll"])
    return PerplexityResult.from_sum(
        nll_sum, len(stream) - 1, n_bytes, seq_len=options.seq_len, stride=stride, windows=len(windows),
        documents=len(texts), elapsed_s=time.perf_counter() - start,
    )  # fmt: skip


def vllm_throughput(
    worker: VllmWorker, res: ModelResult, options: EvalOptions, contexts: list[int]
) -> list[DecodePoint]:
    """Output tokens/s at each (concurrency, prompt length), ``options.rounds`` interleaved rounds each."""
    grid = [(b, c) for c in contexts for b in options.batch_sizes]
    n = options.new_tokens
    # one untimed request first: first-call costs
    worker.request("throughput", concurrency=1, prompt_tokens=8, output_tokens=4, seed=options.seed)

    def one(i: int, r: int) -> float:
        batch, context = grid[i]
        reply = worker.request(
            "throughput", concurrency=batch, prompt_tokens=context, output_tokens=n, seed=options.seed + r
        )
        return reply["output_tokens"] / reply["seconds"]

    points = []
    for (batch, context), rounds in zip(grid, interleaved(len(grid), options.rounds, one), strict=True):
        stats = round_stats(rounds)
        kv_tokens = context + n - 1  # as the hf engine counts: the last output token is never fed back
        points.append(
            DecodePoint(
                batch=batch, context=context, new_tokens=n, tokens_per_s=stats.median,
                decode_ms=1000 * batch / stats.median if stats.median else None,
                kv_bytes=None,  # vLLM's paged cache is not read back per request: predicted only
                kv_bytes_predicted=res.kv_bytes_per_token * batch * kv_tokens, kv_tokens=kv_tokens,
                bytes_per_step=res.weight_bytes + res.kv_bytes_per_token * batch * (context + n // 2),
                rounds=list(stats.rounds), spread=stats.spread, reliable=stats.reliable,
            )
        )  # fmt: skip
    return points


def vllm_decode_rounds(
    paths: list[str],
    *,
    batch: int,
    context: int,
    new_tokens: int,
    rounds: int,
    dtype: str = "float32",
    kv_budget: int = 1,
) -> list[tuple[int | None, list[float]]]:
    """Each checkpoint's KV capacity (tokens in ``kv_budget`` GiB) and output tokens/s per round at
    ``batch`` concurrent sequences of ``context`` random prompt tokens and ``new_tokens`` output tokens.

    One vLLM engine at a time (several at once would not fit beside the others on a small machine), so
    the rounds of one model run back to back after one untimed request; their spread shows a change of
    load within them.

    Raises:
        GqakitError: with the install commands when no Python with vLLM is found.
    """
    python = require_vllm()
    out = []
    for path in paths:
        head_dim = AttentionGeometry.from_config(read_config(Path(path))).head_dim
        with VllmWorker(
            path, python, dtype=dtype, kv_budget_gib=kv_budget, max_model_len=context + new_tokens,
            head_dim=head_dim,
        ) as worker:  # fmt: skip
            worker.request("throughput", concurrency=1, prompt_tokens=8, output_tokens=4, seed=0)
            tps = []
            for r in range(rounds):
                reply = worker.request(
                    "throughput", concurrency=batch, prompt_tokens=context, output_tokens=new_tokens, seed=r
                )
                tps.append(reply["output_tokens"] / reply["seconds"])
            out.append((worker.kv_tokens, tps))
    return out


def measure_vllm_model(
    label: str, path: str, *, config: Any, options: EvalOptions, texts: list[str] | None, contexts: list[int]
) -> ModelResult:
    """Measure ``path`` in vLLM and return its :class:`~gqakit.eval.results.ModelResult` (see the module
    docstring)."""
    python = require_vllm(options)
    limit = max_positions(config)
    if texts is not None and limit is not None and options.seq_len + 1 > limit:
        # vLLM scores a window's targets as prompt tokens: the prompt is the window plus its last target
        raise GqakitError(
            f"[{label}] --seq-len {options.seq_len} with --engine vllm needs {options.seq_len + 1} "
            f"positions, and this model has {limit}; use --seq-len {limit - 1} or less."
        )
    geom = AttentionGeometry.from_config(config.to_dict())
    tokenizer = load_tokenizer(path)
    prefix = prefix_token_id(tokenizer)
    prompts = [[prefix, *tokenizer(p, add_special_tokens=False)["input_ids"]] for p in PROMPTS]

    # transformers first: the greedy reference, the parameter and weight-byte counts; freed before vLLM.
    start = time.perf_counter()
    model = load_causal_lm(path, dtype=_dtype(options, config), device=options.device)
    reference = _reference_greedy(model, prompts, options.new_tokens)
    dtype = next(model.parameters()).dtype
    res = ModelResult.of(
        label, path, geom, parameters=sum(p.numel() for p in model.parameters()),
        dtype=f"vllm {str(dtype).removeprefix('torch.')}", kv_dtype_bytes=dtype_bytes(dtype),
        weight_bytes=weight_bytes_per_step(model), load_s=0.0,
    )  # fmt: skip
    del model
    gc.collect()
    if resolve_device(options.device).type == "cuda":
        torch.cuda.empty_cache()  # vLLM sizes its share from the GPU memory free when it starts

    needed = max([options.seq_len + 2, *(len(p) + options.new_tokens for p in prompts)])
    if options.bench:
        needed = max(needed, max(contexts) + options.new_tokens)
    on_gpu = resolve_device(options.device).type == "cuda"
    with VllmWorker(
        path, python, dtype=_dtype(options, config), kv_budget_gib=options.kv_budget,
        max_model_len=min(needed, limit) if limit else needed, head_dim=geom.head_dim, seed=options.seed,
        gpu_memory_utilization=(options.gpu_memory_utilization or 0.9) if on_gpu else None,
    ) as worker:  # fmt: skip
        res.load_s = time.perf_counter() - start
        res.serving = ServingResult(
            engine=f"vllm {worker.version}",
            kv_budget_bytes=None if on_gpu else int(options.kv_budget * 2**30),
            kv_tokens=worker.kv_tokens,
            block_size=worker.block_size,
            context=options.seq_len,
        )
        log.info("[%s] vLLM KV cache: %s tokens", label, worker.kv_tokens)
        tokens = worker.request("greedy", prompts=prompts, max_tokens=options.new_tokens)["tokens"]
        res.serving.greedy = GreedyAgreement.compare(tokens, reference)
        log.info("[%s] vLLM greedy tokens identical: %s", label, res.serving.greedy.describe())
        if texts is not None:
            res.perplexity = vllm_perplexity(worker, tokenizer, texts, options)
            ppl = res.perplexity
            log.info("[%s] vLLM perplexity %.4f over %d tokens", label, ppl.ppl, ppl.tokens)
        if options.bench:
            res.decode = vllm_throughput(worker, res, options, contexts)
    if options.tasks:  # lm-eval starts its own vLLM engine: after this one has freed its memory
        res.lm_eval = run_vllm_lm_eval(
            python, path, options.tasks, args=parse_lm_eval_args(options.lm_eval_args),
            dtype=_dtype(options, config), max_length=options.seq_len, seed=options.seed,
            batch_size=options.batch_size, kv_budget_gib=None if on_gpu else options.kv_budget,
            gpu_memory_utilization=(options.gpu_memory_utilization or 0.9) if on_gpu else None,
        )  # fmt: skip
    return res


__all__ = [
    "PROMPTS",
    "measure_vllm_model",
    "require_vllm",
    "vllm_decode_rounds",
    "vllm_perplexity",
    "vllm_throughput",
]
