"""The UTF-8 bytes of a text that its first ``k`` tokens spell, for bits per byte under ``--max-tokens``.

Byte-level BPE (GPT-2's: SmolLM2, Llama 3, Qwen ...) and SentencePiece's byte fallback (``<0xE6>``
pieces: Llama 2, Mistral ...) spell a character with no piece of its own as 1-4 byte tokens, so a cut
after ``k`` tokens can keep part of a character::

    "ab日c"  ->  a  b  <E6> <97> <A5>  c        k = 3 keeps 3 bytes: a, b and E6

Character offsets give every byte token of 日 the whole character (5 bytes for k = 3), and ``decode``
spells the kept E6 as U+FFFD, itself 3 bytes: neither is what was scored. So the bytes of a cut
character are counted from the kept tokens themselves.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece byte fallback: one byte


@functools.cache
def _byte_level_alphabet() -> frozenset[str]:
    """The 256 characters byte-level BPE writes bytes as (GPT-2's ``bytes_to_unicode``): printable Latin-1
    stands for itself, the other 68 bytes for U+0100 onwards; a token of them is one byte per character."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    return frozenset(map(chr, printable + list(range(0x100, 0x100 + 256 - len(printable)))))


def piece_bytes(piece: str) -> int | None:
    """Bytes one byte-level or byte-fallback token stands for, or None for a piece that is neither.

    Only pieces that end inside a character are measured this way, and only byte pieces can: a whole-word
    SentencePiece piece such as ``é`` would read as one byte-level byte here, but never ends mid-character.
    """
    if _BYTE_PIECE.fullmatch(piece):
        return 1
    alphabet = _byte_level_alphabet()
    return len(piece) if piece and all(c in alphabet for c in piece) else None


def kept_bytes(
    tokenizer, text: str, ids: Sequence[int], k: int, offsets: Sequence[tuple[int, int]] | None = None
) -> int:
    """UTF-8 bytes of ``text`` that its first ``k`` tokens ``ids[:k]`` spell (``0 < k <= len(ids)``).

    Args:
        tokenizer: the tokenizer that made ``ids`` from ``text``.
        text: the whole text.
        ids: its tokens (no special tokens added).
        k: how many of them are kept.
        offsets: each token's ``(start, end)`` character span (a fast tokenizer's offset mapping); None:
            the kept text is found with ``tokenizer.decode`` instead.

    Returns:
        The bytes of the whole characters the kept tokens cover, plus the bytes they keep of a character
        the cut splits. Should a token inside a split character be no byte token (never seen), the split
        character counts whole.
    """
    if offsets is not None:

        def splits(j: int) -> bool:  # token j starts inside the character token j - 1 ends in
            return offsets[j][0] < offsets[j - 1][1]

        def before(j: int) -> int:
            return len(text[: offsets[j - 1][1]].encode("utf-8"))

    else:

        def splits(j: int) -> bool:
            # A character is at most 4 byte tokens, so the last 4 show whether the cut leaves one open.
            return tokenizer.decode(list(ids[max(0, j - 4) : j])).endswith("\ufffd")

        def before(j: int) -> int:
            return len(tokenizer.decode(list(ids[:j])).encode("utf-8"))

    # Walk back to the last token that ends between characters; the tokens after it are byte tokens.
    j = k
    while 0 < j < len(ids) and splits(j):
        j -= 1
    if j == k:
        return before(k)
    tail = [piece_bytes(p) for p in tokenizer.convert_ids_to_tokens(list(ids[j:k]))]
    if None in tail:
        return before(k)
    return (before(j) if j else 0) + sum(tail)
