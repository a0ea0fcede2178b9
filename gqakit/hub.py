"""Fetching a checkpoint from the Hugging Face Hub, for a ``SRC`` that is a hub id (``org/name``)."""

from __future__ import annotations

import os
from pathlib import Path

from gqakit.errors import GqakitError

# What a conversion needs of a hub repository: config, weights (safetensors only) and tokenizer files.
PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


def looks_like_hub_id(src: str) -> bool:
    """``org/name``: two non-empty parts, not a relative path."""
    parts = src.split("/")
    return len(parts) == 2 and all(parts) and not src.startswith((".", "~")) and os.sep == "/"


def download_from_hub(repo_id: str) -> Path:
    """The local snapshot of ``repo_id`` (huggingface_hub's cache), or one message saying what to do
    offline."""
    try:
        # deferred: huggingface_hub is needed only for a hub id, and it is slow to import
        from huggingface_hub import snapshot_download

        local = snapshot_download(repo_id, allow_patterns=PATTERNS)
    except Exception as e:
        raise GqakitError(
            f"{repo_id!r} is not a local path, and fetching it from the Hugging Face Hub failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). If you are offline, "
            "download the model elsewhere and pass its local directory."
        ) from None
    return Path(local)


__all__ = ["download_from_hub", "looks_like_hub_id"]
