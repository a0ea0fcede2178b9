"""Assets built on this machine rather than fetched: ``gqakit replicate``'s pretrained MHA model.

A pipeline that trains something other commands can use publishes it into the asset cache
(:func:`publish`): a copy of the checkpoint and an ``asset.json`` saying what built it and with which
settings. ``gqakit assets list`` then lists it beside the fetched assets, and
:func:`gqakit.assets.fetch_asset` returns its paths; before it is built, both say which command builds it.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gqakit import __version__
from gqakit.asset_cache import MANIFEST, AssetPaths, read_manifest
from gqakit.errors import GqakitError
from gqakit.files import cache_root, writable_cache, write_json
from gqakit.outputs import atomic_output_dir


@dataclass(frozen=True)
class BuiltAsset:
    """An asset a gqakit command builds: its name, what it is, and the command that builds it."""

    name: str
    description: str
    command: str
    license: str = "the training text's (wiki-en: CC-BY-SA-4.0)"


BUILT: dict[str, BuiltAsset] = {
    "replicate-mha": BuiltAsset(
        "replicate-mha",
        "a genuinely multi-head Llama model pretrained from scratch on wiki-en (gqakit replicate)",
        "gqakit replicate",
    )
}


def publish(
    name: str, model_dir: Path, info: dict[str, Any], cache_dir: str | Path | None = None
) -> AssetPaths:
    """Copy the checkpoint ``model_dir`` into the cache as the built asset ``name`` (atomically), with
    ``info`` (settings, measurements) in its manifest."""
    spec = BUILT[name]
    root = writable_cache(cache_root(cache_dir)) / name
    with atomic_output_dir(root, force=True) as tmp:
        shutil.copytree(model_dir, tmp / "model")
        manifest = {
            "name": name,
            "built_by": spec.command,
            "description": spec.description,
            "license": spec.license,
            "files": {"model": "model"},
            "info": info,
            "gqakit": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_json(tmp / MANIFEST, manifest)
    return AssetPaths(name, root, {"model": root / "model"}, manifest)


def built_asset(name: str, cache_dir: str | Path | None = None) -> AssetPaths:
    """The paths of a built asset; an error naming the command that builds it when it is not built yet."""
    spec = BUILT[name]
    root = cache_root(cache_dir) / name
    manifest = read_manifest(root)
    if manifest is None:
        raise GqakitError(f"Asset {name} is built on this machine, not fetched: run `{spec.command}` first.")
    return AssetPaths(name, root, {k: root / v for k, v in manifest["files"].items()}, manifest)


__all__ = ["BUILT", "BuiltAsset", "built_asset", "publish"]
