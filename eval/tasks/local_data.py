"""Data loaders for the offline gqakit lm-eval tasks (``custom_dataset: !function local_data.load_*``),
given the task's metadata as keyword arguments (docs/eval.md); default files are found next to this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gqakit.text import DOC_SEPARATOR, load_texts

HERE = Path(__file__).resolve().parent
MC_FIELDS = ("question", "choices", "answer")


def resolve_file(value: str | None, default: str) -> Path:
    """``value`` (absolute, or relative to the current directory) or ``default`` beside this module."""
    path = HERE / default if not value else Path(str(value)).expanduser()
    path = path if path.is_absolute() else Path.cwd() / path
    if not path.is_file():
        raise FileNotFoundError(f"gqakit task data {path} does not exist.")
    return path.resolve()


def load_ppl(ppl_file: str | None = None, ppl_text_field: str = "text", **_: Any):
    """One document: the text file, or the rows of a jsonl/parquet file joined as gqakit perplexity
    joins them, so ``gqakit_ppl`` scores exactly the stream ``gqakit eval --ppl-data`` scores."""
    # deferred: datasets takes seconds to import
    import datasets

    path = str(resolve_file(ppl_file, "gqakit_ppl.txt"))
    texts = load_texts(path, text_field=ppl_text_field, option="metadata ppl_file")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([{"text": DOC_SEPARATOR.join(texts)}])})


def load_mc(mc_file: str | None = None, **_: Any):
    """Rows of ``{"question": str, "choices": [str, ...], "answer": int}`` from a jsonl file."""
    # deferred: datasets takes seconds to import
    import datasets

    path = resolve_file(mc_file, "gqakit_mc.jsonl")
    ds = datasets.load_dataset("json", data_files={"test": str(path)}, split="test")
    missing = [f for f in MC_FIELDS if f not in ds.column_names]
    if missing:
        raise ValueError(f"{path}: every row needs {', '.join(MC_FIELDS)}; missing {', '.join(missing)}.")
    return datasets.DatasetDict({"test": ds})
