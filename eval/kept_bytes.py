"""The UTF-8 bytes of a text that its first ``k`` tokens spell, for bits per byte under ``--max-tokens``.

Byte-level BPE (GPT-2's: SmolLM2, Llama 3, Qwen ...) and SentencePiece's byte fallback (``<0xE6>``
pieces: Llama 2, Mistral ...) spell a character with no piece of its own as 1-4 byte tokens, so a cut
after ``k`` tokens can keep part of a character::

    "ab日c"  ->  a  b  <E6> <97> <A5>  c        k = 3 keeps 3 bytes: a, b and E6

Character offsets give every byte token of 日 the whole character (5 bytes for k = 3), and ``decode``
spells the kept E6 as U+FFFD, itself 3 bytes: neither is what was scored. So the kept bytes are read
from the tokens' pieces: a byte-level piece is one byte a character, a ``<0xNN>`` piece one byte, any
other SentencePiece piece its text with ``▁`` a space, an added token its text. When the pieces read
so spell the text, the tokenizer's own space in front of it (SentencePiece's ``add_dummy_prefix``,
ByteLevel's ``add_prefix_space``) aside, the first ``k`` of them spell exactly what was kept. Offsets
trimmed of their spaces (a ByteLevel post-processor's ``trim_offsets``) and decoders that drop a
leading space never come into it.

Where the pieces do not spell the text (a normalizer that changes it, an added token that takes in
the spaces beside it, ``<unk>``), the offsets or ``decode`` give the text the kept tokens cover, and
the byte pieces the cut keeps of a character it splits count one byte each.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback: one byte


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """The character byte-level BPE writes each of the 256 bytes as (GPT-2's ``bytes_to_unicode``),
    mapped to that byte: printable Latin-1 stands for itself, the other 68 bytes for U+0100 onwards."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(others)}


def _byte_level(piece: str) -> bytes | None:
    """The bytes a byte-level BPE piece stands for, or None for a piece with a character outside its
    alphabet."""
    alphabet = _byte_level_alphabet()
    return bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece) else None


def _sentencepiece(piece: str) -> bytes:
    """The bytes a SentencePiece piece stands for: ``<0xNN>`` that byte, any other its text, ``▁`` a
    space."""
    byte = _BYTE_PIECE.fullmatch(piece)
    return bytes([int(byte[1], 16)]) if byte else piece.replace("▁", " ").encode("utf-8")


def piece_bytes(piece: str) -> int | None:
    """Bytes one byte-level or byte-fallback token stands for, or None for a piece that is neither.

    Only pieces that end inside a character are measured this way, and only byte pieces can: a whole-word
    SentencePiece piece such as ``é`` would read as one byte-level byte here, but never ends mid-character.
    """
    if _BYTE_PIECE.fullmatch(piece):
        return 1
    spelled = _byte_level(piece)
    return len(spelled) if piece and spelled is not None else None


def spelled_bytes(tokenizer, text: str, ids: Sequence[int]) -> list[int] | None:
    """The UTF-8 bytes of ``text`` each of its tokens ``ids`` stands for, read from the tokens' pieces.

    The pieces are read as byte-level BPE's, else as SentencePiece's (an added token as its text either
    way); the first reading whose bytes are the text's is taken. A space the tokenizer put in front of
    the text is not in it: the first token is counted without it. Not read so: tokens among ``ids`` that
    take in the spaces beside them (added tokens with ``lstrip``/``rstrip``, or of spaces only), whose
    pieces can spell the text with a space in the wrong token.

    Args:
        tokenizer: the tokenizer that made ``ids`` from ``text``.
        text: the whole text.
        ids: its tokens (no special tokens added).

    Returns:
        One count a token, summing to the text's bytes; None when neither reading spells the text.
    """
    tokens = getattr(tokenizer, "added_tokens_decoder", {})
    if any(
        i in tokens and (tokens[i].lstrip or tokens[i].rstrip or tokens[i].content.isspace()) for i in ids
    ):
        # such a token takes in the spaces beside it, and the pre-tokenizer may put one back in front of
        # the next piece: the pieces still spell the text with a space counted in the wrong token
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


def _leading_spaces(piece: str) -> int:
    """The characters a ByteLevel post-processor with ``trim_offsets`` moves a token's start past."""
    return next((i for i, c in enumerate(piece) if c != "Ġ" and not c.isspace()), len(piece))


def kept_bytes(
    tokenizer, text: str, ids: Sequence[int], k: int, offsets: Sequence[tuple[int, int]] | None = None
) -> int:
    """UTF-8 bytes of ``text`` that its first ``k`` tokens ``ids[:k]`` spell (``0 < k <= len(ids)``).

    The bytes the pieces stand for (:func:`spelled_bytes`) where they spell the text; else the offsets or
    ``decode`` give the text the kept tokens cover, up to a character the cut splits, whose kept byte
    tokens are counted one byte each.

    Args:
        tokenizer: the tokenizer that made ``ids`` from ``text``.
        text: the whole text.
        ids: its tokens (no special tokens added).
        k: how many of them are kept.
        offsets: each token's ``(start, end)`` character span (a fast tokenizer's offset mapping); None:
            the kept text is found with ``tokenizer.decode`` instead.

    Returns:
        The bytes the kept tokens stand for: the whole characters they cover, plus the bytes they keep
        of a character the cut splits. Where the pieces do not spell the text, should a token inside a
        split character be no byte token (a SentencePiece ``▁`` put in front of the text), the split
        character counts whole.
    """
    spelled = spelled_bytes(tokenizer, text, ids)
    if spelled is not None:
        return sum(spelled[:k])
    if offsets is not None:

        def splits(j: int) -> bool:  # token j starts inside the character token j - 1 ends in
            return offsets[j][0] < offsets[j - 1][1]

        def before(j: int) -> int:
            # Trimmed offsets (trim_offsets) end token j - 1 before its trailing spaces and start token j
            # after its leading ones: the boundary is the later of that end and token j's start less them.
            end = offsets[j - 1][1]
            if j < len(ids):
                lead = _leading_spaces(tokenizer.convert_ids_to_tokens([ids[j]])[0])
                end = max(end, offsets[j][0] - lead)
            return len(text[:end].encode("utf-8"))

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
