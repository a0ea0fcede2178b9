"""kept_bytes against the bytes the first k tokens stand for, on tiny tokenizers of every layout it meets.

The tokenizers are built here with ``tokenizers``: byte-level BPE (GPT-2's layout) with and without a
ByteLevel post-processor that trims offsets, and with a prefix space (RoBERTa's); SentencePiece-style BPE
and Unigram with byte fallback and a Metaspace pre-tokenizer that puts ``▁`` in front of the text (Llama
2's and Mistral's layout) or not (Gemma's); and a lowercasing byte-level BPE, whose pieces do not spell
the text, for the ``decode`` way. The truth is read from the pieces with nothing of
:mod:`gqakit.eval.kept_bytes`: a byte-level piece is one byte a character (transformers' own
``bytes_to_unicode``), a ``<0xNN>`` piece one byte, any other SentencePiece piece the UTF-8 of its text
with ``▁`` a space, less the one space the tokenizer put in front, which is not in the text (lowercasing
keeps every character's UTF-8 length in these texts, so the lowercased pieces give the truth too).
"""

from __future__ import annotations

import functools
import json
import random

import pytest

from gqakit.eval.kept_bytes import kept_bytes, spelled_bytes

_CORPUS = [
    "The cache that stores keys and values shrinks by the number of query heads per group.",
    "def f(x):\n    return x  # two spaces\n\n        deeper\n\tand a tab\n",
    "Café crème, naïve façade: bytes are not characters. Ærøskøbing, straße, Ωmega.",
    "日本語のテキスト、日本。 本日は晴れ。",
    "a  b   c    d     e",
]

_TEXTS = [
    "The cache shrinks by the number of heads.",
    "a  b   c    d     e",
    "line one\nline two\n\n  indented\n    more\n",
    "\tTabs\tand\r\nCRLF  \n",
    "日本語のテキスト、日本。",
    "emoji 😀👍🏽 end",
    "Café crème, naïve façade — Ærøskøbing",
    "日本 starts with a multi-byte character",
    "😀 starts with an emoji",
    "é",
    "€",
    "€uro",
    "日",
    " leading space",
    "   three leading",
    "trailing spaces   ",
    "\nnewline first",
    "x",
    "mixed 日x本y😀z é ",
]
_FRAGMENTS = ["a", "the", "The", "x", ".", " ", "  ", "\n", "\n  ", "\t", "日", "本", "語", "😀", "👍🏽", "é"]
_FRAGMENTS += ["É", "ß", "€", "Ω", "ø", "ĳ", "—"]
_RANDOM = random.Random(20240611)
_TEXTS += ["".join(_RANDOM.choices(_FRAGMENTS, k=_RANDOM.randint(1, 14))) for _ in range(40)]


def _wrap(tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@functools.cache
def _byte_level(trim_offsets: bool, prefix_space: bool = False, lowercase: bool = False):
    """GPT-2's layout: every byte a token of its own at least; RoBERTa's trims offsets, adds a space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 3, trainer)
    return _wrap(tok)


def _metaspace(scheme: str):
    from tokenizers import decoders, pre_tokenizers

    pre = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    # Llama 2's decoder drops the space it put in front
    return pre, decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if scheme != "never" else []))


_BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]


@functools.cache
def _sentencepiece_bpe(scheme: str):
    """Llama 2's layout: BPE over the corpus' characters, ``<0xNN>`` for the bytes of any other."""
    from tokenizers import Tokenizer, models, trainers

    pre, decoder = _metaspace(scheme)
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40, show_progress=False
    )
    trained.train_from_iterator(_CORPUS * 3, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for piece in _BYTE_PIECES:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer, tok.decoder = pre, decoder
    return _wrap(tok)


@functools.cache
def _sentencepiece_unigram(scheme: str):
    """A Unigram model over the corpus' characters, ``<0xNN>`` for the bytes of any other."""
    from tokenizers import Tokenizer, models, trainers

    pre, decoder = _metaspace(scheme)
    trained = Tokenizer(models.Unigram())
    trained.pre_tokenizer = pre
    trainer = trainers.UnigramTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", show_progress=False
    )
    trained.train_from_iterator(_CORPUS * 3, trainer)
    vocab = [tuple(v) for v in json.loads(trained.to_str())["model"]["vocab"]]
    vocab += [(piece, -50.0) for piece in _BYTE_PIECES if piece not in dict(vocab)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer, tok.decoder = pre, decoder
    return _wrap(tok)


def _byte_level_truth(tok, text: str, ids: list[int], prefix_space: bool) -> list[int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    spelled = [bytes(byte_of[c] for c in piece) for piece in tok.convert_ids_to_tokens(ids)]
    truth = [len(s) for s in spelled]
    if prefix_space and not text.startswith(" "):  # the space ByteLevel(add_prefix_space) put in front
        assert spelled[0].startswith(b" ")
        truth[0] -= 1
    return truth


def _sentencepiece_truth(tok, text: str, ids: list[int], scheme: str) -> list[int]:
    truth = []
    for piece in tok.convert_ids_to_tokens(ids):
        is_byte = len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")
        truth.append(1 if is_byte else len(piece.replace("▁", " ").encode("utf-8")))
    if scheme != "never" and not text.startswith(" "):  # the ▁ Metaspace put in front
        assert tok.convert_ids_to_tokens(ids[:1])[0].startswith("▁")
        truth[0] -= 1
    return truth


_TOKENIZERS = {
    "byte-level": (lambda: _byte_level(False), lambda t, s, i: _byte_level_truth(t, s, i, False)),
    "byte-level-trim": (lambda: _byte_level(True), lambda t, s, i: _byte_level_truth(t, s, i, False)),
    "byte-level-prefix-trim": (
        lambda: _byte_level(True, prefix_space=True),
        lambda t, s, i: _byte_level_truth(t, s, i, True),
    ),
    **{
        f"sp-bpe-{scheme}": (
            functools.partial(_sentencepiece_bpe, scheme),
            functools.partial(_sentencepiece_truth, scheme=scheme),
        )
        for scheme in ("first", "always", "never")
    },
    **{
        f"sp-unigram-{scheme}": (
            functools.partial(_sentencepiece_unigram, scheme),
            functools.partial(_sentencepiece_truth, scheme=scheme),
        )
        for scheme in ("first", "never")
    },
}


def _mismatches(name: str) -> list[tuple[str, int, int, int]]:
    make, truth_of = _TOKENIZERS[name]
    tok = make()
    found = []
    for text in _TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        truth = truth_of(tok, text, ids)
        assert sum(truth) == len(text.encode("utf-8")), (text, tok.convert_ids_to_tokens(ids))
        for k in range(1, len(ids) + 1):
            got = kept_bytes(tok, text, ids, k)
            if got != sum(truth[:k]):
                found.append((text, k, got, sum(truth[:k])))
    return found


@pytest.mark.parametrize("name", list(_TOKENIZERS))
def test_kept_bytes_are_the_bytes_the_kept_tokens_stand_for(name):
    """Every cut of every text: kept_bytes is the bytes its tokens stand for, a split character's kept
    bytes included, the tokenizer's own leading space not."""
    assert _mismatches(name) == []


def test_pieces_that_do_not_spell_the_text_go_by_decode():
    """The lowercasing tokenizer's pieces spell the text lowercased: its cuts are counted by decode."""
    tok = _byte_level(True, lowercase=True)
    for text, spells in [("The Cache  日本", False), ("the cache  日本", True)]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert (spelled_bytes(tok, text, ids) is not None) == spells
        assert kept_bytes(tok, text, ids, len(ids)) == len(text.encode())


@pytest.mark.parametrize(
    "added, text",
    [
        # RoBERTa's <mask> takes in the space after it, then the pre-tokenizer puts one back in front of
        # "The": the pieces spell the text, but the space counts in the wrong token
        ({"content": "<mask>", "rstrip": True, "special": True}, "<mask> The cache"),
        # a whitespace added token beside the space the pre-tokenizer adds in front of the text
        ({"content": "  ", "normalized": False}, "  x"),
    ],
    ids=["rstrip-token", "whitespace-token"],
)
def test_added_tokens_that_move_spaces_are_not_read_from_their_pieces(added, text):
    from tokenizers import AddedToken

    tok = _byte_level.__wrapped__(False, prefix_space=True)  # a fresh one: tokens are added to it
    tok.add_tokens([AddedToken(**added)])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert spelled_bytes(tok, text, ids) is None
