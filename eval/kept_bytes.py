"""The UTF-8 bytes of a text that its first ``k`` tokens spell, for bits per byte under ``--max-tokens``.

A byte-level or byte-fallback tokenizer spells a character it has no piece for as 1-4 byte tokens, so a
cut after ``k`` tokens can keep part of a character::

    "ab日c"  ->  a  b  <E6> <97> <A5>  c        k = 3 keeps 3 bytes: a, b and E6

Offsets and ``decode`` both miscount that (docs/eval.md), so the kept bytes are read from the tokens'
pieces where they spell the text, else from the kept tokens' decoded text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback: one byte


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """The character byte-level BPE writes each of the 256 bytes as, mapped to that byte."""
    # deferred: transformers takes seconds to import
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _byte_level(piece: str) -> bytes | None:
    """The bytes a byte-level BPE piece stands for; None for a character outside its alphabet."""
    alphabet = _byte_level_alphabet()
    return bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else None


def _sentencepiece(piece: str) -> bytes:
    """The bytes a SentencePiece piece stands for: ``<0xNN>`` that byte, any other its text, ``▁`` a space."""
    byte = _BYTE_PIECE.fullmatch(piece)
    return bytes([int(byte[1], 16)]) if byte else piece.replace("▁", " ").encode("utf-8")


def spelled_bytes(tokenizer, text: str, ids: Sequence[int]) -> list[int] | None:
    """The UTF-8 bytes of ``text`` each of its tokens ``ids`` (no special tokens added) stands for.

    The pieces are read as byte-level BPE's, else as SentencePiece's (an added token as its text either
    way); the first reading whose bytes are the text's is taken. A space the tokenizer put in front of
    the text is not in it: the first token is counted without it. Not read so: added tokens that take in
    the spaces beside them (``lstrip``/``rstrip``, or of spaces only), whose pieces can spell the text with
    a space in the wrong token.

    Returns:
        One count a token, summing to the text's bytes; None when neither reading spells the text.
    """
    tokens = getattr(tokenizer, "added_tokens_decoder", {})
    if any(
        i in tokens and (tokens[i].lstrip or tokens[i].rstrip or tokens[i].content.isspace()) for i in ids
    ):
        return None
    added = {i: t.content.encode("utf-8") for i, t in tokens.items()}
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    data = text.encode("utf-8")
    # the tokenizer's own space goes in front of a piece of the text, never of an added token
    fronts = (data,) if ids and ids[0] in added else (data, b" " + data)
    for read in (_byte_level, _sentencepiece):
        spelled = [added[i] if i in added else read(p) for i, p in zip(ids, pieces, strict=True)]
        if not spelled or None in spelled:
            continue
        whole = b"".join(spelled)
        if whole in fronts:
            counts = [len(s) for s in spelled]
            counts[0] -= len(whole) - len(data)
            return counts
    return None


def kept_bytes(tokenizer, text: str, ids: Sequence[int], k: int) -> int:
    """UTF-8 bytes of ``text`` that its first ``k`` tokens ``ids[:k]`` spell (``0 < k <= len(ids)``):
    :func:`spelled_bytes` where the pieces spell the text, else the bytes of the kept tokens' decoded text."""
    spelled = spelled_bytes(tokenizer, text, ids)
    if spelled is not None:
        return sum(spelled[:k])
    return len(tokenizer.decode(list(ids[:k])).encode("utf-8"))
