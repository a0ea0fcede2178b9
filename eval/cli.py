"""``gqakit eval``: parse the options, call :func:`gqakit.eval.api.evaluate`, write the report."""

from __future__ import annotations

import shlex
import sys

import click

from gqakit.cli_options import device_option, dtype_option, out_option, progress_option, seed_option
from gqakit.eval.api import EvalOptions, evaluate
from gqakit.eval.engines import ENGINES
from gqakit.eval.report import write_report
from gqakit.gguf.tensors import OUT_TYPES
from gqakit.models import DTYPES
from gqakit.outputs import writable_dir


@click.command("eval")
@click.argument("model")
@click.option("--baseline", help="Checkpoint to compare MODEL with (directory or hub id).")
@click.option(
    "--ppl-data",
    help="Text for perplexity: .txt (one document), .jsonl/.parquet (one per row) or a hub dataset name.",
)
@click.option("--text-field", default="text", show_default=True, help="Text column of a table or dataset.")
@click.option("--split", default="test", show_default=True, help="Split of a hub dataset.")
@click.option("--data-config", help="Configuration of a hub dataset (e.g. wikitext-2-raw-v1).")
@click.option(
    "--seq-len",
    type=int,
    default=512,
    show_default=True,
    help="Tokens per perplexity window (also lm-eval's max_length).",
)
@click.option("--stride", type=int, help="Tokens scored per window after the first [default: seq-len].")
@click.option(
    "--batch-size",
    type=int,
    default=8,
    show_default=True,
    help="Perplexity windows per forward pass (also lm-eval's batch size).",
)
@click.option("--max-tokens", type=int, help="Score at most this many tokens of --ppl-data.")
@click.option("--bench", is_flag=True, help="Measure decode speed and KV-cache memory over the grid.")
@click.option("--batch-sizes", default="1,8,32", show_default=True, help="Decode batch sizes.")
@click.option(
    "--contexts",
    help="Decode prompt lengths [default: 256,1024,4096, less any beyond the model's positions].",
)
@click.option("--new-tokens", type=int, default=32, show_default=True, help="Tokens generated per point.")
@click.option("--warmup", type=int, default=1, show_default=True, help="Untimed runs before each point.")
@click.option("--static-cache", is_flag=True, help="Decode with a static KV cache.")
@click.option(
    "--compile", "compile_", is_flag=True, help="torch.compile the decode step (implies --static-cache)."
)
@click.option("--tasks", help="lm-eval tasks, comma-separated (offline: gqakit_ppl, gqakit_mc).")
@click.option("--lm-eval-args", default="", help='More lm-eval options, e.g. "--num_fewshot 5 --limit 100".')
@device_option()
@dtype_option(list(DTYPES), "auto", "Compute dtype; auto: the checkpoint's.")
@out_option("report", "Directory for report.md, results.json and the plots.")
@seed_option("Seed for prompts, lm-eval and torch.")
@progress_option()
@click.option(
    "--engine",
    type=click.Choice(ENGINES.names),
    default="hf",
    show_default=True,
    help=ENGINES.describe() + ".",
)
@click.option(
    "--gguf-type",
    type=click.Choice(list(OUT_TYPES)),
    default="f16",
    show_default=True,
    help="Weights of the llama.cpp engine; f32 also keeps its KV cache in float32 (transformers' numbers).",
)
@click.option(
    "--vllm-python",
    help="Python with vLLM, for --engine vllm [default: $GQAKIT_VLLM_PYTHON, else this one].",
)
@click.option(
    "--kv-budget",
    type=int,
    default=1,
    show_default=True,
    help="KV-cache memory of --engine vllm on a CPU, GiB (VLLM_CPU_KVCACHE_SPACE).",
)
@click.option(
    "--gpu-memory-utilization",
    type=float,
    help="Share of GPU memory --engine vllm may take (weights + KV cache) [default: 0.9].",
)
@click.option(
    "--rounds", type=int, default=3, show_default=True, help="Throughput rounds per point of --engine vllm."
)
def eval_cmd(
    model: str,
    baseline: str | None,
    ppl_data: str | None,
    text_field: str,
    split: str,
    data_config: str | None,
    seq_len: int,
    stride: int | None,
    batch_size: int,
    max_tokens: int | None,
    bench: bool,
    batch_sizes: str,
    contexts: str | None,
    new_tokens: int,
    warmup: int,
    static_cache: bool,
    compile_: bool,
    tasks: str | None,
    lm_eval_args: str,
    device: str,
    dtype: str,
    out: str,
    seed: int,
    progress: bool,
    engine: str,
    gguf_type: str,
    vllm_python: str | None,
    kv_budget: int,
    gpu_memory_utilization: float | None,
    rounds: int,
) -> None:
    """Measure MODEL (and --baseline): perplexity, lm-eval tasks, decode speed and KV memory.

    \b
    gqakit eval ./smollm2-mqa --baseline ./smollm2 --ppl-data wiki.test.txt --bench --out report/
    gqakit eval ./llama2-gqa8 --baseline ./Llama-2-7b-hf --tasks hellaswag,arc_easy --device cuda
    gqakit eval ./smollm2-mqa --baseline ./smollm2-mha --engine llamacpp --bench --contexts 512,2048,4096
    gqakit eval ./smollm2-mqa --baseline ./smollm2-mha --engine vllm --bench --batch-sizes 1,8,32,128
    """
    writable_dir(out, "--out")  # before the evaluation, not after it

    options = EvalOptions(
        ppl_data=ppl_data,
        text_field=text_field,
        split=split,
        data_config=data_config,
        seq_len=seq_len,
        stride=stride,
        batch_size=batch_size,
        max_tokens=max_tokens,
        bench=bench,
        batch_sizes=batch_sizes,
        contexts=contexts,
        new_tokens=new_tokens,
        warmup=warmup,
        static_cache=static_cache,
        compile=compile_,
        tasks=tasks or (),
        lm_eval_args=lm_eval_args,
        device=device,
        dtype=dtype,
        seed=seed,
        progress=progress,
        engine=engine,
        gguf_type=gguf_type,
        vllm_python=vllm_python,
        kv_budget=kv_budget,
        gpu_memory_utilization=gpu_memory_utilization,
        rounds=rounds,
        command_line=" ".join(shlex.quote(a) for a in ["gqakit", *sys.argv[1:]]),
    )
    results = evaluate(model, baseline, options)
    report = write_report(results, out)
    text = report.read_text()
    # The headline table: from the first table row to the first blank line after it.
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    click.echo("\n".join(lines[start:end]))
    click.echo(f"\nWrote {report}, {report.parent / 'results.json'} and the plots.")
