"""The vLLM engine of ``gqakit eval --engine vllm``: a checkpoint served as GPU users deploy it.

vLLM's paged KV cache stores each K/V head once, so a model with G K/V heads holds H/G times the tokens of
its MHA original in the same memory. Each checkpoint directory is loaded as it is (no export) in a vLLM
worker process (:mod:`gqakit.eval.vllm_client`), and this engine fills the same
:class:`~gqakit.eval.results.ModelResult` as the others, plus its
:class:`~gqakit.eval.results.ServingResult`:

* perplexity over exactly the transformers engine's windows (:func:`~gqakit.eval.perplexity.encode_stream`,
  :func:`~gqakit.eval.perplexity.sliding_windows`): each window's token ids go to vLLM as a prompt, and its
  prompt log-probabilities score the window's last ``scored`` tokens;
* greedy continuations of :data:`PROMPTS`, compared token by token with transformers' on the same
  checkpoint (loaded here first, and freed before vLLM starts);
* the KV-cache capacity vLLM allocated for ``kv_budget`` GiB (CPU) and the sequences of ``--seq-len``
  tokens it holds at once;
* with ``--bench``: output tokens/s at each concurrency (``--batch-sizes``) and prompt length
  (``--contexts``), ``--new-tokens`` tokens per sequence, ``rounds`` rounds interleaved across the points
  (:func:`~gqakit.eval.decode_rounds.interleaved`), the median with its spread and reliability
  (:func:`~gqakit.eval.decode_rounds.round_stats`);
* with ``--tasks``: lm-eval's own ``vllm`` model type in vLLM's Python (:func:`run_vllm_lm_eval`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import gqakit.text as gqakit_text
from gqakit.checkpoint import read_config
from gqakit.dtypes import config_dtype, dtype_name
from gqakit.errors import GqakitError
from gqakit.eval.decode import DecodePoint, free_memory
from gqakit.eval.decode_rounds import interleaved, round_stats
from gqakit.eval.kv_bytes import weight_bytes_per_step
from gqakit.eval.lm_eval_bridge import LmEvalArgs, check_tasks, lm_eval_settings, parse_lm_eval_args
from gqakit.eval.options import EvalOptions
from gqakit.eval.perplexity import PerplexityResult, Window, prefix_token_id, windowed_perplexity
from gqakit.eval.results import GreedyAgreement, ModelResult, ServingResult
from gqakit.eval.vllm_client import WORKER, VllmWorker, check_cpu, vllm_python
from gqakit.geometry import AttentionGeometry
from gqakit.models import load_causal_lm, load_tokenizer, max_positions, resolve_device

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
    return options.dtype if options.dtype != "auto" else dtype_name(config_dtype(config))


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

    def score(stream: list[int], windows: list[Window]) -> float:
        nll_sum = 0.0
        for i in range(0, len(windows), WINDOWS_PER_REQUEST):
            group = windows[i : i + WINDOWS_PER_REQUEST]
            # A window's inputs stream[start:end] predict stream[start+1:end+1]: vLLM scores each prompt
            # token given the ones before it, so the prompt is stream[start:end+1] and its last ``scored``
            # count.
            prompts = [stream[w.start : w.end + 1] for w in group]
            nll_sum += sum(worker.request("nll", windows=prompts, scored=[w.scored for w in group])["nll"])
        return nll_sum

    return windowed_perplexity(
        tokenizer, texts, score, seq_len=options.seq_len, stride=options.stride, max_tokens=options.max_tokens
    )


def _tokens_per_s(worker: VllmWorker, batch: int, context: int, new_tokens: int, seed: int) -> float:
    """Output tokens/s of ``batch`` random prompts of ``context`` tokens sent at once, ``new_tokens`` each."""
    reply = worker.request(
        "throughput", concurrency=batch, prompt_tokens=context, output_tokens=new_tokens, seed=seed
    )
    return reply["output_tokens"] / reply["seconds"]


def vllm_throughput(
    worker: VllmWorker, res: ModelResult, options: EvalOptions, contexts: list[int]
) -> list[DecodePoint]:
    """Output tokens/s at each (concurrency, prompt length), ``options.rounds`` interleaved rounds each."""
    grid = [(b, c) for c in contexts for b in options.batch_sizes]
    n = options.new_tokens
    _tokens_per_s(worker, 1, 8, 4, options.seed)  # one untimed request first: first-call costs

    def one(i: int, r: int) -> float:
        return _tokens_per_s(worker, *grid[i], n, options.seed + r)

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
            _tokens_per_s(worker, 1, 8, 4, 0)  # untimed: first-call costs
            out.append(
                (
                    worker.kv_tokens,
                    [_tokens_per_s(worker, batch, context, new_tokens, r) for r in range(rounds)],
                )
            )
    return out


# What our tasks' data loader (tasks/local_data.py) imports from gqakit: linked into a bare package on
# vLLM's PYTHONPATH, so that Python never sees gqakit's own dependencies (its transformers differs).
_SHIM_MODULES = ("text.py", "errors.py")


def _shim(root: Path) -> Path:
    package = root / "gqakit"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    here = Path(gqakit_text.__file__).resolve().parent
    for name in _SHIM_MODULES:
        (package / name).symlink_to(here / name)
    return root


def run_vllm_lm_eval(
    python: str, path: str, tasks: list[str] | tuple[str, ...], *, args: LmEvalArgs, dtype: str,
    max_length: int, seed: int, batch_size: int, kv_budget_gib: int | None,
    gpu_memory_utilization: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run lm-eval ``tasks`` on the checkpoint ``path`` with lm-eval's own ``vllm`` model type in
    ``python`` (which needs lm-eval beside vLLM), our task directory registered as for ``--engine hf``.

    ``args`` is ``--lm-eval-args`` parsed (``max_length`` and the like go to lm-eval's ``VLLM``);
    ``kv_budget_gib`` is vLLM's KV-cache memory on a CPU (None on a GPU), ``gpu_memory_utilization`` its
    share of a GPU's memory (None on a CPU). Returns what :func:`gqakit.eval.lm_eval_bridge.run_lm_eval`
    returns.

    Raises:
        GqakitError: unknown tasks, lm-eval missing from that Python, or lm-eval's failure (its last line).
    """
    check_tasks(tasks, args)
    model_args: dict[str, Any] = {
        "pretrained": path, "dtype": dtype, "max_length": max_length,
        "seed": seed, "batch_size": batch_size, **args.hflm,
    }  # fmt: skip
    if gpu_memory_utilization is not None:
        model_args["gpu_memory_utilization"] = gpu_memory_utilization
    settings = {"model_args": model_args, "tasks": list(tasks), **lm_eval_settings(tasks, args, seed)}
    with tempfile.TemporaryDirectory(prefix="gqakit-vllm-lm-eval-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(_shim(Path(tmp)))}
        if kv_budget_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_budget_gib)
        command = [python, str(WORKER), json.dumps(settings)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        if "No module named 'lm_eval'" in proc.stderr:
            raise GqakitError(
                f"--tasks with --engine vllm runs lm-eval in vLLM's Python ({python}), which has no lm-eval: "
                f'{python} -m pip install "lm-eval>=0.4.10"'
            )
        raise GqakitError(f"lm-eval in vLLM could not run {', '.join(tasks)}: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
    vllm_dtype = _dtype(options, config)
    start = time.perf_counter()
    model = load_causal_lm(path, dtype=vllm_dtype, device=options.device)
    reference = _reference_greedy(model, prompts, options.new_tokens)
    dtype = next(model.parameters()).dtype
    res = ModelResult.of(
        label, path, geom, parameters=sum(p.numel() for p in model.parameters()),
        dtype=f"vllm {dtype_name(dtype)}", kv_dtype_bytes=dtype.itemsize,
        weight_bytes=weight_bytes_per_step(model), load_s=0.0,
    )  # fmt: skip
    del model
    free_memory(options.device)  # vLLM sizes its share from the GPU memory free when it starts

    needed = max([options.seq_len + 2, *(len(p) + options.new_tokens for p in prompts)])
    if options.bench:
        needed = max(needed, max(contexts) + options.new_tokens)
    on_gpu = resolve_device(options.device).type == "cuda"
    share = (options.gpu_memory_utilization or 0.9) if on_gpu else None
    with VllmWorker(
        path, python, dtype=vllm_dtype, kv_budget_gib=options.kv_budget,
        max_model_len=min(needed, limit) if limit else needed, head_dim=geom.head_dim, seed=options.seed,
        gpu_memory_utilization=share,
    ) as worker:  # fmt: skip
        res.load_s = time.perf_counter() - start
        res.serving = ServingResult(
            engine=f"vllm {worker.version}",
            kv_budget_bytes=None if on_gpu else int(options.kv_budget * 2**30),
            kv_tokens=worker.kv_tokens,
            block_size=worker.block_size,
            context=options.seq_len,
        )
        tokens = worker.request("greedy", prompts=prompts, max_tokens=options.new_tokens)["tokens"]
        res.serving.greedy = GreedyAgreement.compare(tokens, reference)
        if texts is not None:
            res.perplexity = vllm_perplexity(worker, tokenizer, texts, options)
        if options.bench:
            res.decode = vllm_throughput(worker, res, options, contexts)
    if options.tasks:  # lm-eval starts its own vLLM engine: after this one has freed its memory
        res.lm_eval = run_vllm_lm_eval(
            python, path, options.tasks, args=parse_lm_eval_args(options.lm_eval_args),
            dtype=vllm_dtype, max_length=options.seq_len, seed=options.seed,
            batch_size=options.batch_size, kv_budget_gib=None if on_gpu else options.kv_budget,
            gpu_memory_utilization=share,
        )  # fmt: skip
    return res
