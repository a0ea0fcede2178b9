"""The tokenizer as the GGUF holds it: both kinds llama.cpp reads, pre-tokenizer names, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_helpers import spm_tokenizer
from tiny_models import tiny_tokenizer

from gqakit.errors import GqakitError
from gqakit.gguf.vocab import load_vocab


def _save(tok, path: Path) -> Path:
    tok.save_pretrained(path)
    return path


def _with_pre(tmp_path: Path, pre_tokenizer, normalizer=None) -> Path:
    tok = tiny_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.backend_tokenizer.normalizer = normalizer
    return _save(tok, tmp_path / "tok")


def test_pre_tokenizer_names(tmp_path: Path) -> None:
    from tokenizers import Regex, normalizers, pre_tokenizers

    from gqakit.gguf.vocab import _LLAMA3_RE, _QWEN2_RE

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    split = lambda rx: pre_tokenizers.Split(Regex(rx), behavior="isolated")  # noqa: E731
    cases = {
        "gpt-2": (pre_tokenizers.ByteLevel(add_prefix_space=False), None),
        "smollm": (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                            pre_tokenizers.ByteLevel(add_prefix_space=False)]), None),
        "llama-bpe": (pre_tokenizers.Sequence([split(_LLAMA3_RE), byte_level]), None),
        "qwen2": (pre_tokenizers.Sequence([split(_QWEN2_RE), byte_level]), normalizers.NFC()),
    }  # fmt: skip
    for i, (name, (pre, norm)) in enumerate(cases.items()):
        vocab = load_vocab(_with_pre(tmp_path / str(i), pre, norm), 384)
        assert (vocab.model, vocab.pre) == ("gpt2", name), name


def test_unknown_pre_tokenizer_writes_default(tmp_path: Path) -> None:
    from tokenizers import pre_tokenizers

    vocab = load_vocab(_with_pre(tmp_path, pre_tokenizers.ByteLevel(add_prefix_space=True)), 384)
    assert vocab.pre == "default"


@pytest.mark.parametrize("prefix", [False, True])
def test_sentencepiece_style_tokens(tmp_path: Path, prefix: bool) -> None:
    path = _save(spm_tokenizer(prepend_space=prefix), tmp_path / "spm")
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = load_vocab(path, 448)
    assert (vocab.model, vocab.pre, vocab.special.merges) == ("llama", "default", [])
    assert vocab.add_space_prefix is prefix  # Llama 2 prepends a space, Gemma does not
    assert vocab.types[:4] == [3, 3, 3, 2]  # <pad> <eos> <bos> CONTROL, <unk> UNKNOWN
    assert vocab.tokens[4] == "<0x00>" and set(vocab.types[4:260]) == {6}  # BYTE
    n = len(spec["model"]["vocab"])
    assert set(vocab.types[260:n]) == {1} and set(vocab.types[n:]) == {5}
    # scores order the pieces as the merges do: the k-th merge's result scores -k
    merges = spec["model"]["merges"]
    for rank in (0, 1, len(merges) - 1):
        left, right = merges[rank] if isinstance(merges[rank], list) else merges[rank].split(" ")
        assert vocab.scores[spec["model"]["vocab"][left + right]] == -(rank + 1)
    assert vocab.scores[4] == 0.0  # a byte token is never a merge result
    assert vocab.special.add_special_token == {"bos": True, "eos": False}  # measured, not guessed
    assert vocab.special.special_token_ids["bos"] == 2 and vocab.special.special_token_ids["unk"] == 3


def test_add_bos_follows_the_tokenizer(tmp_path: Path) -> None:
    vocab = load_vocab(_save(spm_tokenizer(add_bos=False), tmp_path / "t"), 448)
    assert vocab.special.add_special_token["bos"] is False


def test_chat_template_is_embedded(tmp_path: Path) -> None:
    path = _save(tiny_tokenizer(), tmp_path / "t")
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    vocab = load_vocab(path, 384)
    assert vocab.special.chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_added_tokens_past_the_embedding_are_left_out(tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    base = len(tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    vocab = load_vocab(_save(tok, tmp_path / "t"), base)
    assert len(vocab.tokens) == base and "<|extra|>" not in vocab.tokens


def test_a_tokenizer_larger_than_the_embedding_is_refused(tmp_path: Path) -> None:
    path = _save(spm_tokenizer(), tmp_path / "t")
    with pytest.raises(GqakitError, match="ids up to .* embedding has only 300 rows"):
        load_vocab(path, 300)


def test_wordpiece_is_refused_naming_the_class(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    path = _save(PreTrainedTokenizerFast(tokenizer_object=wp, unk_token="[UNK]"), tmp_path / "wp")
    with pytest.raises(GqakitError) as err:
        load_vocab(path, 16)
    msg = str(err.value)
    assert "PreTrainedTokenizerFast" in msg or "TokenizersBackend" in msg
    assert "WordPiece" in msg and "byte-level BPE" in msg and "byte-fallback BPE" in msg


def test_no_tokenizer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(GqakitError, match="no tokenizer gqakit can embed.*tokenizer.json"):
        load_vocab(tmp_path, 16)


def test_sentencepiece_model_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    # only a tokenizer.model (here a bogus one): transformers cannot build a fast tokenizer from it
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(GqakitError, match="LlamaTokenizer.*tokenizer.json"):
        load_vocab(tmp_path, 16)
