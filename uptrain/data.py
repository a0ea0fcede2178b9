"""Training text -> fixed-length token blocks, cached by ``datasets``.

Documents (local files or a hub dataset) are tokenized with the model's tokenizer, ended with EOS,
concatenated and cut into blocks of ``seq_len`` tokens, the tail that does not fill a block dropped (per
1,000 documents, as in transformers' ``run_clm``). Each step is a ``datasets`` ``map``, so a second run
with the same text, tokenizer and ``seq_len`` reads the blocks from the cache. Validation is
``val_files``, the hub's ``val_split``, or a seeded random ``val_fraction`` of the blocks.
"""

from __future__ import annotations

import glob
import hashlib
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

from gqakit.errors import GqakitError, did_you_mean
from gqakit.uptrain.recipe import expand
from gqakit.uptrain.recipe_schema import DataConfig

# File suffix -> datasets builder.
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_PACK_BATCH = 1000


@dataclass
class Blocks:
    """Packed token blocks, ``input_ids`` of length ``seq_len`` each, as torch-formatted datasets."""

    train: Any
    val: Any  # at most data.max_val_blocks
    seq_len: int
    source: str  # where the text came from, for the log and provenance


def resolve_files(patterns: list[str], key: str, problems: list[str]) -> list[str]:
    """Expand globs; record a problem for a pattern that matches nothing or an unsupported suffix."""
    files: list[str] = []
    for pattern in patterns:
        path = expand(pattern)
        found = sorted(glob.glob(path)) if glob.has_magic(path) else ([path] if Path(path).is_file() else [])
        if not found:
            what = "matches no file" if glob.has_magic(path) else "does not exist"
            problems.append(f"{key}: {pattern} {what}.")
            continue
        for f in found:
            if Path(f).suffix.lower() not in BUILDERS:
                problems.append(f"{key}: {f} has an unsupported suffix; use {', '.join(BUILDERS)} files.")
            else:
                files.append(str(Path(f).resolve()))
    return files


def _documents(cfg: DataConfig, val: bool = False) -> tuple[Any, str, str, str] | None:
    """The training (``val``: validation) documents as a ``datasets`` table, with their text column, their
    name for messages and their source for the log; None for validation held out of the training blocks.
    """
    # deferred: datasets takes seconds to import
    import datasets

    if cfg.hub:
        split = cfg.val_split if val else cfg.split
        if split is None:
            return None
        try:
            ds = datasets.load_dataset(cfg.hub, cfg.hub_config, split=split)
        except Exception as e:  # datasets raises many types for what it cannot load
            raise GqakitError(
                f"data.hub {cfg.hub} (split {split!r}) could not be loaded ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}). Hub datasets need a network connection; "
                "offline, download the text and give data.files."
            ) from None
        name = cfg.hub + (f"/{cfg.hub_config}" if cfg.hub_config else "")
        return ds, cfg.text_field, f"data.hub {cfg.hub} [{split}]", f"{name} [{split}]"
    key = "data.val_files" if val else "data.files"
    problems: list[str] = []
    files = resolve_files(cfg.val_files if val else cfg.files, key, problems)
    if problems:
        raise GqakitError(" ".join(problems))
    if not files:
        return None
    builder = BUILDERS[Path(files[0]).suffix.lower()]  # one type: preflight refuses a mix
    try:  # a .txt file: one document per line
        ds = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as e:  # datasets raises many types for unreadable files
        raise GqakitError(f"{key} could not be read as {builder} ({type(e).__name__}: {e}).") from None
    return ds, "text" if builder == "text" else cfg.text_field, key, ", ".join(files)


def _tokenize(batch: dict[str, list], tokenizer: Any, field: str, eos: int | None) -> dict[str, list]:
    """A batch of documents -> their token ids, each ended with ``eos`` (unless None); blank ones dropped."""
    texts = [t for t in batch[field] if t and t.strip()]
    ids = tokenizer(texts)["input_ids"] if texts else []
    if eos is not None:
        ids = [x if x and x[-1] == eos else [*x, eos] for x in ids]
    return {"input_ids": ids}


def _pack(batch: dict[str, list], seq_len: int) -> dict[str, list]:
    """A batch of token lists -> one stream cut into blocks of ``seq_len`` (the tail that does not fill
    one is dropped)."""
    stream = list(chain.from_iterable(batch["input_ids"]))
    n = len(stream) // seq_len * seq_len
    return {"input_ids": [stream[i : i + seq_len] for i in range(0, n, seq_len)]}


def tokenizer_digest(tokenizer: Any) -> str:
    """A hash of what the tokenizer does (vocabulary, merges, special tokens), not of where it was loaded.

    ``datasets`` would hash the tokenizer object, path included, so the same tokenizer copied into a new
    run directory would miss the cache.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    extra = repr((type(tokenizer).__name__, tokenizer.bos_token_id, tokenizer.eos_token_id))
    return hashlib.sha256((text + extra).encode()).hexdigest()[:16]


def pack_documents(ds: Any, field: str, tokenizer: Any, cfg: DataConfig, what: str):
    """Tokenize the ``field`` column of ``ds`` and pack it into ``cfg.seq_len`` blocks (cached)."""
    # deferred: datasets takes seconds to import
    from datasets.fingerprint import Hasher

    if field not in ds.column_names:
        raise GqakitError(
            f"{what} has no field {field!r}; its fields are {', '.join(ds.column_names)}."
            f"{did_you_mean(field, ds.column_names)} Set data.text_field."
        )
    eos = tokenizer.eos_token_id if cfg.add_eos else None
    tokens = ds.map(
        _tokenize,
        fn_kwargs={"tokenizer": tokenizer, "field": field, "eos": eos},
        batched=True,
        remove_columns=ds.column_names,
        num_proc=cfg.num_proc,
        desc=f"tokenize {what}",
        new_fingerprint=Hasher.hash(
            ("tokenize-v1", ds._fingerprint, tokenizer_digest(tokenizer), field, cfg.add_eos)
        ),
    )
    if len(tokens) == 0:  # no documents, or only empty ones
        raise GqakitError(f"{what} holds no text: every document is empty.")
    blocks = tokens.map(
        _pack,
        fn_kwargs={"seq_len": cfg.seq_len},
        batched=True,
        batch_size=_PACK_BATCH,
        num_proc=cfg.num_proc,
        desc="pack",
        new_fingerprint=Hasher.hash(("pack-v1", tokens._fingerprint, cfg.seq_len)),
    )
    if len(blocks) == 0:
        total = sum(len(x) for x in tokens["input_ids"])
        raise GqakitError(
            f"{what} gives {total:,} tokens, fewer than one block of data.seq_len={cfg.seq_len}: add text "
            f"or lower data.seq_len."
        )
    return blocks


def build_blocks(cfg: DataConfig, tokenizer: Any, seed: int = 0) -> Blocks:
    """Load, tokenize and pack the training and validation text of a recipe.

    Raises:
        GqakitError: files missing or unreadable, no text field, no text, fewer tokens than one block.
    """
    ds, field, what, source = _documents(cfg)
    train = pack_documents(ds, field, tokenizer, cfg, what)
    val_docs = _documents(cfg, val=True)
    if val_docs is not None:
        ds, field, what, _ = val_docs
        val = pack_documents(ds, field, tokenizer, cfg, what)
    else:
        n_val = max(1, round(len(train) * cfg.val_fraction))
        if len(train) - n_val < 1:
            raise GqakitError(
                f"The training text gives {len(train)} block(s) of {cfg.seq_len} tokens: too few to hold out "
                f"data.val_fraction={cfg.val_fraction} for validation. Add text, lower data.seq_len, or give "
                "data.val_files."
            )
        split = train.train_test_split(test_size=n_val, shuffle=True, seed=seed)
        train, val = split["train"], split["test"]
    if cfg.max_val_blocks is not None and len(val) > cfg.max_val_blocks:
        val = val.select(range(cfg.max_val_blocks))
    as_torch = {"type": "torch", "columns": ["input_ids"]}
    return Blocks(train.with_format(**as_torch), val.with_format(**as_torch), cfg.seq_len, source)
