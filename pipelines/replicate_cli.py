"""``gqakit replicate``: parse the options, run :func:`gqakit.pipelines.replicate.run_replicate`."""

from __future__ import annotations

from pathlib import Path

import click

from gqakit.pipelines.replicate_options import ReplicateOptions


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


@click.command("replicate")
@click.option("--out", type=click.Path(file_okay=False), default="replicate-report", show_default=True)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False),
    default="replicate-work",
    show_default=True,
    help="Checkpoints and cached results; a second run reuses them.",
)
@click.option(
    "--scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Model width (x) and depth (x sqrt) and every token budget: 1 runs in under an hour on 2 CPU "
    "cores; 4 or more for a GPU.",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda.")
@click.option("--seeds", default="0,1", show_default=True, help="Seeds of the headline comparison.")
@click.option(
    "--alphas",
    default="0,0.025,0.05,0.1",
    show_default=True,
    help="Uptraining proportions of the pretraining tokens.",
)
@click.option("--groups", default="1,2,4", show_default=True, help="K/V head counts of the G sweep.")
@click.option(
    "--methods",
    default="mean,first,random,calibrated,refined",
    show_default=True,
    help="Conversion methods of the MQA arms (refined: calibrated + layer-wise refinement).",
)
@click.option(
    "--uptrain-lr",
    type=float,
    default=ReplicateOptions.uptrain_lr,
    show_default=True,
    help="Peak learning rate of the uptraining runs (and the MHA model's continued training).",
)
@click.option("--fresh", is_flag=True, help="Recompute everything instead of reusing --work-dir.")
@click.option(
    "--pretrain-only",
    is_flag=True,
    help="Only train the tokenizer and the MHA model (recipes/replicate-mha.yaml) and make it the asset "
    "replicate-mha.",
)
@click.option("--cache-dir", type=click.Path(file_okay=False), help="Asset cache [default: $GQAKIT_CACHE].")
@click.option("--wheelhouse", type=click.Path(file_okay=False), help="Asset wheels from this directory.")
def replicate_cmd(
    out: str,
    work_dir: str,
    scale: float,
    device: str,
    seeds: str,
    alphas: str,
    groups: str,
    methods: str,
    uptrain_lr: float,
    fresh: bool,
    pretrain_only: bool,
    cache_dir: str | None,
    wheelhouse: str | None,
) -> None:
    """Re-run the GQA paper's experiments (Ainslie et al. 2023) on an MHA model pretrained here: which
    start (Fig. 4), how much uptraining (Fig. 5), how many groups (Fig. 6, Table 1), uptrained against
    trained from scratch; with gqakit's calibrated merge and refinement beside the paper's methods."""
    from gqakit.errors import GqakitError
    from gqakit.pipelines.replicate import pretrain_mha, run_replicate

    try:
        lists = dict(seeds=_ints(seeds), alphas=_floats(alphas), groups=_ints(groups))
    except ValueError:
        raise GqakitError(
            f"--seeds {seeds!r}, --alphas {alphas!r} and --groups {groups!r} are comma-separated numbers."
        ) from None
    options = ReplicateOptions(
        out=Path(out),
        work_dir=Path(work_dir),
        scale=scale,
        device=device,
        methods=tuple(m.strip() for m in methods.split(",") if m.strip()),
        uptrain_lr=uptrain_lr,
        fresh=fresh,
        cache_dir=Path(cache_dir) if cache_dir else None,
        wheelhouse=Path(wheelhouse) if wheelhouse else None,
        **lists,
    )
    if pretrain_only:
        click.echo(f"MHA model: {pretrain_mha(options)}")
        return
    run_replicate(options)
