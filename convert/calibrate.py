"""Calibration: the text a calibrated conversion runs on, and what each layer's K/V projections see.

Each layer keeps only ``[X, 1]^T [X, 1]`` of its K/V projection input (:func:`batch_gram`), never the
activations. Text shorter than ``--calib-tokens`` stops the conversion (a merge fitted on fewer tokens
than asked for would be a silent change of settings).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import torch

from gqakit.checkpoint import Checkpoint
from gqakit.errors import GqakitError
from gqakit.models import load_tokenizer, max_positions
from gqakit.storage import sha256_file
from gqakit.text import DOC_SEPARATOR, load_texts

CALIB_SEQ_LEN = 512  # tokens per calibration sequence (capped by the model's max positions)
CALIB_BATCH = 4  # calibration sequences per forward pass


def load_calibration_texts(path: str | Path, text_field: str = "text") -> list[str]:
    """Read calibration documents (``.txt``: one document; ``.jsonl``/``.json``/``.parquet``: one per row)."""
    p = Path(str(path)).expanduser()
    if not p.is_file():
        raise GqakitError(
            f"--calib-data {path} does not exist. Give a .txt, .jsonl or .parquet file of text in the "
            "model's domain, e.g. the train split of `gqakit assets fetch wiki-en`."
        )
    return load_texts(p, text_field, option="--calib-data")


def calibration_ids(
    tokenizer, texts: Sequence[str], tokens: int, seq_len: int = CALIB_SEQ_LEN, source: str = "--calib-data"
) -> list[torch.Tensor]:
    """The first ``tokens`` tokens of the joined documents, cut into sequences of at most ``seq_len``."""
    text = DOC_SEPARATOR.join(texts)
    chars = max(tokens * 8, 4096)
    while True:  # tokenize only as much text as needed (a train split can be megabytes)
        ids = tokenizer(text[:chars], add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) > tokens or chars >= len(text):
            break
        chars *= 4
    if len(ids) < tokens:
        raise GqakitError(
            f"{source} holds {len(ids):,} tokens but --calib-tokens asks for {tokens:,}. Give more text, or "
            f"pass --calib-tokens {len(ids)} or less (the merge needs at least a few times the head_dim)."
        )
    ids = torch.tensor(ids[:tokens])
    return list(ids.split(seq_len))


def batch_gram(x: torch.Tensor) -> torch.Tensor:
    """``[X, 1]^T [X, 1]`` of one batch of projection inputs ``[..., hidden]``, as float64 on the CPU."""
    x = x.reshape(-1, x.shape[-1]).float()
    x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)], dim=1)
    return (x.T @ x).double().cpu()


def batches(sequences: Sequence[torch.Tensor], batch_size: int):
    """Stack runs of equal-length sequences into batches of at most ``batch_size``.

    Calibration batches 4 sequences (:data:`CALIB_BATCH`).
    """
    for _, same_length in itertools.groupby(sequences, len):
        run = list(same_length)
        for i in range(0, len(run), batch_size):
            yield torch.stack(run[i : i + batch_size])


def calibration_sequences(ckpt: Checkpoint, data: str | Path, tokens: int) -> list[torch.Tensor]:
    """The first ``tokens`` tokens of ``data`` under ``ckpt``'s tokenizer, in sequences of
    ``CALIB_SEQ_LEN`` (or the model's maximum positions, when shorter)."""
    tokenizer = load_tokenizer(ckpt.path)
    seq_len = min(CALIB_SEQ_LEN, max_positions(SimpleNamespace(**ckpt.config)) or CALIB_SEQ_LEN)
    return calibration_ids(tokenizer, load_calibration_texts(data), tokens, seq_len)


def calibration_record(data: str | Path, tokens: int, sequences: Sequence[torch.Tensor], device: str) -> dict:
    """What a calibration ran on, for provenance: the text's path and sha256, tokens, length, device."""
    return {
        "path": str(Path(str(data)).expanduser().resolve()),
        "sha256": sha256_file(Path(str(data)).expanduser()),
        "tokens": tokens,
        "seq_len": len(sequences[0]),
        "device": device,
    }
