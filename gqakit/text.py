"""Text for every verb: local ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` files, or a hub dataset,
read by one rule (docs/eval.md), so a number means the same thing whichever file it came from: a ``.txt``
file is one document, its text exactly as stored; a table or a hub dataset gives one document per row
(empty rows dropped). Perplexity and calibration then join the documents with :data:`DOC_SEPARATOR`.
"""

from __future__ import annotations

from pathlib import Path

from gqakit.errors import GqakitError, did_you_mean

# How documents are joined into one stream for perplexity: a paragraph break, as the text itself would
# write it. Plain text (not a special token) so that every tokenizer sees the same bytes and bits per
# byte compare across tokenizers; the separator's bytes are counted like any other text.
DOC_SEPARATOR = "\n\n"

_TABLE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_texts(
    source: str | Path,
    text_field: str = "text",
    split: str = "test",
    config: str | None = None,
    option: str = "--ppl-data",
) -> list[str]:
    """Read evaluation documents from a local file or a hub dataset.

    Args:
        source: a ``.txt`` file (one document: the whole file), a ``.jsonl`` / ``.json`` /
            ``.parquet`` file (one document per row), or a hub dataset name (online only).
        text_field: the column holding the text, for tables and hub datasets.
        split: the split of a hub dataset (local files have one split).
        config: the configuration of a hub dataset (``wikitext-2-raw-v1``...).
        option: the command-line option the source came from, named in error messages.

    Returns:
        The non-empty documents, in file order.

    Raises:
        GqakitError: the file is missing or empty, the text field is absent, or the dataset cannot be
            loaded.
    """
    path = Path(str(source)).expanduser()
    if path.is_dir():
        raise GqakitError(f"{option} {source} is a directory; point at a .txt, .jsonl or .parquet file.")
    builder = _TABLE_BUILDERS.get(path.suffix.lower())
    suffixed = path.suffix.lower() in {".txt", *_TABLE_BUILDERS}
    if path.is_file() and builder:
        if builder == "json":
            read_text_file(path, option)  # datasets lets a UnicodeDecodeError through
        texts = _load_table(source, option, text_field, builder, "train", data_files=str(path.resolve()))
    # any other file, or a path-like name (./x, /x, ~/x, a/b/c, x.txt) rather than a hub dataset's owner/name
    elif path.is_file() or str(source).startswith((".", "/", "~")) or str(source).count("/") > 1 or suffixed:
        texts = [read_text_file(path, option)]  # any other file is text; a missing one is named
    else:
        texts = _load_table(
            source, option, text_field, str(source), split, **({"name": config} if config else {})
        )
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise GqakitError(f"{option} {source} holds no text (every document is empty).")
    return texts


def read_text_file(path: str | Path, what: str = "") -> str:
    """The text of a file the user named as ``what`` (``--data``, ``the recipe``, ``config.json``): one
    message, naming it, when it is missing, unreadable or not UTF-8 text.

    Every reader of a user's text file goes through here (or :func:`text_file_problem`, for a check that
    reports it with the other problems of the options), so none ends in a ``UnicodeDecodeError``.
    """
    path = Path(path).expanduser()
    named = f"{what} {path}".strip()
    if not path.is_file():
        raise GqakitError(f"{named} does not exist or is not a file.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise GqakitError(
            f"{named} is not UTF-8 text ({e.reason} at byte {e.start}): give a UTF-8 text file."
        ) from None
    except OSError as e:
        raise GqakitError(f"{named} cannot be read ({e.strerror}).") from None


def text_file_problem(path: str | Path, what: str) -> str | None:
    """What :func:`read_text_file` would refuse in ``path``, or None: for an options ``check``."""
    try:
        read_text_file(path, what)
    except GqakitError as e:
        return e.message
    return None


def _load_table(
    source: str | Path, option: str, text_field: str, path: str, split: str, **kwargs
) -> list[str]:
    """The ``text_field`` column of the dataset ``path`` (a builder name for a local table, or a hub
    dataset), one message naming ``option`` and ``source`` for whatever goes wrong."""
    # deferred: datasets takes seconds to import
    import datasets

    try:
        ds = datasets.load_dataset(path, split=split, **kwargs)
    except Exception as e:  # datasets raises many types (ValueError: no such split, FileNotFoundError...)
        raise GqakitError(f"{option} {source} could not be loaded ({type(e).__name__}: {e}).") from None
    if text_field not in ds.column_names:
        raise GqakitError(
            f"{option} {source} has no field {text_field!r}; its fields are {', '.join(ds.column_names)}."
            f"{did_you_mean(text_field, ds.column_names)} Set text_field to the column that holds the text."
        )
    texts = ds[text_field]
    if not all(isinstance(t, str) or t is None for t in texts):
        raise GqakitError(f"{option} {source}: field {text_field!r} is not text.")
    return [t or "" for t in texts]
