"""The tokenizer, embedded in the GGUF the way llama.cpp's tokenizers read it (``tokenizer.ggml.model``):
byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen2) as ``gpt2`` (tokens, merges, the name of a pre-tokenizer
llama.cpp implements), byte-fallback BPE (Llama 2, Mistral, Gemma, Phi-3: SentencePiece converted to
``tokenizer.json``) as ``llama`` (tokens with scores that order the merges, ``<0xNN>`` byte tokens).
Anything else (Unigram, WordPiece, a slow-only tokenizer) is refused with one message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
from gguf import TokenType

from gqakit.errors import GqakitError

# Pre-tokenizers llama.cpp implements, keyed by what a tokenizer.json states: (normalizer type, the
# pre-tokenizer steps as :func:`_pre_steps` describes them). llama.cpp itself recognises models by
# hashing the tokens of a probe text (convert_hf_to_gguf.py, get_vocab_base_pre); matching the
# stated pipeline covers every model built the same way. The regexes are those the models' own
# tokenizer.json files state; the names are those llama.cpp's llama-vocab.cpp accepts.
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS: dict[tuple[Any, ...], str] = {
    (None, (("ByteLevel", True, False),)): "gpt-2",
    (None, (("Digits", True), ("ByteLevel", True, False))): "smollm",
    (None, (("Split", _LLAMA3_RE, "Isolated", False), ("ByteLevel", False, False))): "llama-bpe",
    ("NFC", (("Split", _QWEN2_RE, "Isolated", False), ("ByteLevel", False, False))): "qwen2",
}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SPACE = "\u2581"  # SentencePiece's visible space
_PROBE = "Hello world, 12 apples."


@dataclass
class Vocab:
    """Everything the GGUF's ``tokenizer.*`` keys hold."""

    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    add_space_prefix: bool | None
    special: gguf.SpecialVocab | None = None  # set by load_vocab

    def add_to(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.add_space_prefix is not None:
            writer.add_add_space_prefix(self.add_space_prefix)
        self.special.add_to_gguf(writer, quiet=True)


def _pre_steps(pre: dict[str, Any] | None) -> tuple[tuple[Any, ...], ...]:
    """A tokenizer.json pre-tokenizer as a flat tuple of the facts that decide how text is split."""
    if pre is None:
        return ()
    kind = pre.get("type")
    if kind == "Sequence":
        return sum((_pre_steps(p) for p in pre.get("pretokenizers", [])), ())
    if kind == "ByteLevel":
        return (("ByteLevel", bool(pre.get("use_regex", True)), bool(pre.get("add_prefix_space", False))),)
    if kind == "Digits":
        return (("Digits", bool(pre.get("individual_digits", False))),)
    if kind == "Split":
        pattern = pre.get("pattern", {})
        regex = pattern.get("Regex", pattern.get("String"))
        return (("Split", regex, pre.get("behavior"), pre.get("invert")),)
    return ((str(kind), json.dumps(pre, sort_keys=True)),)


def _base_tokens(spec: dict[str, Any], n_vocab: int) -> tuple[list[str], list[int]]:
    """Token texts and types for ids ``0..n_vocab-1``; an added token is a control token when special,
    else user-defined.

    Ids the tokenizer does not use become ``[PADi]`` / UNUSED, as llama.cpp's converter pads a
    vocabulary smaller than the embedding. An added token past the embedding (transformers' Qwen2
    tokenizer adds ``<|endoftext|>`` to any vocabulary) cannot be fed to the model: it is left out.
    """
    vocab: dict[str, int] = spec["model"]["vocab"]
    top = max(vocab.values(), default=-1)
    if top >= n_vocab:
        raise GqakitError(
            f"The tokenizer has token ids up to {top}, but the model's embedding has only {n_vocab} rows: "
            "this tokenizer does not belong to this model."
        )
    added = [a for a in spec.get("added_tokens", []) if a["id"] < n_vocab]
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [int(TokenType.UNUSED)] * n_vocab
    for text, i in vocab.items():
        # "[PADi]" at id i is a filler an earlier export wrote (transformers reads it back as a token)
        filler = text == tokens[i]
        tokens[i], types[i] = text, int(TokenType.UNUSED if filler else TokenType.NORMAL)
    for a in added:
        kind = TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED
        tokens[a["id"]], types[a["id"]] = a["content"], int(kind)
    return tokens, types


def _byte_level(spec: dict[str, Any], n_vocab: int) -> Vocab:
    # llama.cpp's name for this tokenizer's pre-tokenizer; 'default' when gqakit does not know it
    stated = ((spec.get("normalizer") or {}).get("type"), _pre_steps(spec.get("pre_tokenizer")))
    return Vocab("gpt2", PRE_TOKENIZERS.get(stated, "default"), *_base_tokens(spec, n_vocab), None, None)


def _byte_fallback(spec: dict[str, Any], n_vocab: int) -> Vocab:
    unk = spec["model"].get("unk_token")
    tokens, types = _base_tokens(spec, n_vocab)
    for i, text in enumerate(tokens):
        if text == unk:  # whether in the vocabulary or added
            types[i] = int(TokenType.UNKNOWN)
        elif types[i] == TokenType.NORMAL and _BYTE_TOKEN.fullmatch(text):
            types[i] = int(TokenType.BYTE)
        elif types[i] == TokenType.USER_DEFINED:
            # llama.cpp matches user-defined tokens against raw text, where a space is a space
            tokens[i] = text.replace(_SPACE, " ")
    # llama.cpp's SentencePiece tokenizer merges the adjacent pair whose result scores highest, where
    # Hugging Face's BPE applies the lowest-ranked merge: score = -rank makes the two agree. Tokens no
    # merge produces (single characters, bytes, specials) never result from a merge; they score 0.
    vocab: dict[str, int] = spec["model"]["vocab"]
    scores = [0.0] * n_vocab
    merged: set[int] = set()
    for rank, m in enumerate(spec["model"].get("merges", [])):
        i = vocab.get("".join(m.split(" ", 1) if isinstance(m, str) else m))
        if i is not None and i not in merged:
            merged.add(i)
            scores[i] = -float(rank + 1)
    return Vocab("llama", "default", tokens, types, scores, _prepends_space(spec))


def _prepends_space(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer puts a ``▁`` before the text (Llama 2 does, Gemma does not): a
    ``Prepend("▁")`` normalizer, or a ``Metaspace`` pre-tokenizer that prepends."""
    steps = []
    for step in (spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}):  # a Sequence: its steps
        steps += [step, *step.get("normalizers", []), *step.get("pretokenizers", [])]
    for n in steps:
        if n.get("type") == "Prepend" and n.get("prepend") == _SPACE:
            return True
        if n.get("type") == "Metaspace":
            scheme = n.get("prepend_scheme")
            return scheme in ("always", "first") if scheme else bool(n.get("add_prefix_space", True))
    return False


# The kinds of tokenizer.json model laid out here, as errors name them.
_SUPPORTED = "byte-fallback BPE (SentencePiece style) or byte-level BPE (GPT-2 style)"


def _declared_class(path: Path) -> str:
    try:
        return str(json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class"))
    except (OSError, ValueError):
        return "unknown"


def load_vocab(path: Path, n_vocab: int) -> Vocab:
    """Read the tokenizer saved with a checkpoint and lay it out for GGUF.

    Args:
        path: the checkpoint directory.
        n_vocab: rows of the embedding; the token list is padded to it.

    Raises:
        GqakitError: the tokenizer is missing, is not a fast tokenizer, or is of a kind llama.cpp's
            GGUF tokenizers cannot reproduce from it.
    """
    # deferred: transformers takes seconds to import
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise GqakitError(
            f"{path} has no tokenizer gqakit can embed in a GGUF ({_declared_class(path)}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). The exporter needs a "
            f"tokenizer.json with a {_SUPPORTED} model."
        ) from None
    cls = type(tok).__name__
    backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if backend is None:
        raise GqakitError(
            f"The tokenizer of {path} is {cls}, a slow tokenizer: the exporter reads tokenizer.json "
            f"({_SUPPORTED}). Save a fast tokenizer with the checkpoint."
        )
    spec = json.loads(backend.to_str())
    model = spec.get("model", {})
    if not model.get("unk_token") and tok.unk_token:
        model["unk_token"] = tok.unk_token  # a tokenizer rebuilt from GGUF declares it only here
    # a BPE without byte fallback works on the byte-level alphabet only with a ByteLevel step
    byte_level = "ByteLevel" in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    if model.get("type") != "BPE" or not (model.get("byte_fallback") or byte_level):
        raise GqakitError(
            f"The tokenizer of {path} is {cls} with a {model.get('type')} model, which gqakit cannot embed "
            f"in a GGUF. Supported: {_SUPPORTED} from tokenizer.json."
        )
    vocab = (_byte_fallback if model.get("byte_fallback") else _byte_level)(spec, n_vocab)
    # gguf's SpecialVocab reads the merges (byte-level BPE: llama.cpp's gpt2 tokenizer applies them; a
    # SentencePiece-style one orders its merges by the scores) and the special tokens from the files
    special = vocab.special = gguf.SpecialVocab(path, load_merges=vocab.model == "gpt2", n_vocab=n_vocab)
    # Whether BOS/EOS are added is measured on the tokenizer itself: it is what transformers (and so
    # gqakit's eval) does, whatever the config files claim.
    with_special = tok(_PROBE, add_special_tokens=True)["input_ids"]
    plain = tok(_PROBE, add_special_tokens=False)["input_ids"]
    extra = len(with_special) > len(plain)
    special.add_special_token = {
        "bos": bool(extra and tok.bos_token_id is not None and with_special[0] == tok.bos_token_id),
        "eos": bool(extra and tok.eos_token_id is not None and with_special[-1] == tok.eos_token_id),
    }
    return vocab
