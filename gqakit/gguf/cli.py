"""``gqakit export``: a checkpoint as a GGUF file for llama.cpp (and ollama, LM Studio)."""

from __future__ import annotations

import click

from gqakit.gguf.export import OUT_TYPES, export_gguf


@click.command("export")
@click.argument("src")
@click.argument("dst", type=click.Path(dir_okay=False))
@click.option(
    "--type",
    "out_type",
    type=click.Choice(OUT_TYPES),
    default="f16",
    show_default=True,
    help="Storage of the weight matrices (norms and biases stay f32): f32 is exact, q8_0 is llama.cpp's "
    "8-bit format.",
)
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@click.option("--progress/--no-progress", default=True, help="Show progress bars of the long steps.")
def export_cmd(src: str, dst: str, out_type: str, force: bool, progress: bool) -> None:
    """Write SRC (a checkpoint directory, .gguf or hub id; MHA, GQA or MQA) as the GGUF file DST, with its
    tokenizer, for llama.cpp."""
    res = export_gguf(src, dst, out_type=out_type, force=force, progress=progress)
    click.echo(
        f"{res.model_type} -> GGUF {res.arch} ({res.out_type}): {res.num_heads} query heads, "
        f"{res.num_kv_heads} K/V heads, {res.tensors} tensors, {res.bytes / 2**20:,.1f} MiB, tokenizer "
        f"{res.tokenizer}; wrote {res.path} ({res.seconds:.1f} s)"
    )
