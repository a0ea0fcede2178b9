"""Perplexity against a direct computation, lm-eval's rolling windows, and the bits-per-byte formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model, tiny_tokenizer

from gqakit.errors import GqakitError
from gqakit.eval.perplexity import encode_stream, perplexity, sliding_windows


@pytest.mark.parametrize(
    "n, seq_len, stride", [(11, 4, 2), (11, 4, 4), (3, 4, 4), (50, 8, 3), (9, 8, 1), (2, 4, 4)]
)
def test_windows_score_every_token_once_within_seq_len(n, seq_len, stride):
    scored = []
    for w in sliding_windows(n, seq_len, stride):
        assert 0 < w.end - w.start <= seq_len
        scored += list(range(w.start + 1, w.end + 1))[-w.scored :]
    assert scored == list(range(1, n))


def _token_nll(model, ids: list[int], context: list[int], target: int) -> float:
    logits = model(input_ids=torch.tensor([context])).logits[0, -1]
    return float(F.cross_entropy(logits.float()[None], torch.tensor([target])))


@torch.no_grad()
def test_disjoint_windows_equal_exp_mean_nll_of_plain_chunks(loaded_mha, known_text):
    """stride = seq_len: chunks of seq_len inputs, each predicting the next seq_len tokens."""
    model, tok = loaded_mha
    seq_len = 16
    stream, _ = encode_stream(tok, [known_text], max_tokens=3 * seq_len)
    total = 0.0
    for i in range(0, len(stream) - 1, seq_len):
        chunk = torch.tensor([stream[i : i + seq_len + 1]])
        logits = model(input_ids=chunk[:, :-1]).logits
        total += float(F.cross_entropy(logits[0].float(), chunk[0, 1:], reduction="sum"))
    expected = math.exp(total / (len(stream) - 1))
    res = perplexity(
        model, tok, [known_text], seq_len=seq_len, max_tokens=3 * seq_len, batch_size=2, progress=False
    )
    assert res.tokens == 3 * seq_len == len(stream) - 1
    assert res.ppl == pytest.approx(expected, rel=1e-5)
    assert res.nll == pytest.approx(math.log(expected), rel=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2 soft-caps its logits after the output layer
def test_scores_come_from_the_models_own_logits(family, known_text):
    """The output layer runs a chunk at a time on the decoder's hidden states where that gives the
    model's logits, and the plain ``model(...).logits`` where the family transforms them."""
    from gqakit.eval.perplexity import _Scorer

    model, tok = tiny_model(family, heads=4, layers=2), tiny_tokenizer()
    model.get_output_embeddings().weight.data *= 300  # logits in the tens, where gemma2's cap at 30 bites
    stream, _ = encode_stream(tok, [known_text], max_tokens=32)
    ids = torch.tensor([stream[:33]])
    expected = F.cross_entropy(model(input_ids=ids[:, :-1]).logits[0], ids[0, 1:], reduction="none")
    scorer = _Scorer(model)
    for _ in range(2):  # the first call decides the path, the second takes it
        torch.testing.assert_close(scorer(ids[:, :-1], ids[:, 1:], None)[0], expected, rtol=1e-5, atol=1e-4)
    assert scorer.chunked == (family == "llama")
    res = perplexity(model, tok, [known_text], seq_len=8, stride=4, max_tokens=32, progress=False)
    direct = [
        _token_nll(model, stream, stream[w.start : t], stream[t])
        for w in sliding_windows(len(stream), 8, 4)
        for t in range(w.end + 1 - w.scored, w.end + 1)
    ]
    assert res.nll == pytest.approx(sum(direct) / len(direct), rel=1e-5)


@torch.no_grad()
def test_stride_one_gives_each_token_seq_len_tokens_of_context(loaded_mha, known_text):
    """stride = 1: token t is predicted from exactly the min(t, seq_len) tokens before it."""
    model, tok = loaded_mha
    seq_len = 8
    stream, _ = encode_stream(tok, [known_text], max_tokens=30)
    nll = [
        _token_nll(model, stream, stream[max(0, t - seq_len) : t], stream[t]) for t in range(1, len(stream))
    ]
    res = perplexity(
        model, tok, [known_text], seq_len=seq_len, stride=1, max_tokens=30, batch_size=4, progress=False
    )
    assert res.ppl == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)


@torch.no_grad()
def test_sliding_stride_matches_a_token_by_token_reference(loaded_mha, known_text):
    """stride < seq_len: each window's scored tokens see everything from the window start."""
    model, tok = loaded_mha
    seq_len, stride = 12, 5
    stream, _ = encode_stream(tok, [known_text], max_tokens=40)
    nll = []
    for w in sliding_windows(len(stream), seq_len, stride):
        for t in range(w.end + 1 - w.scored, w.end + 1):
            nll.append(_token_nll(model, stream, stream[w.start : t], stream[t]))
    res = perplexity(
        model, tok, [known_text], seq_len=seq_len, stride=stride, max_tokens=40, batch_size=3, progress=False
    )
    assert len(nll) == res.tokens == 40
    assert res.ppl == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    # More context than disjoint windows: not the same number.
    disjoint = perplexity(model, tok, [known_text], seq_len=seq_len, max_tokens=40, progress=False)
    assert disjoint.ppl != pytest.approx(res.ppl, rel=1e-6)


@torch.no_grad()
def test_disjoint_windows_equal_lm_eval_rolling_windows(loaded_mha, known_text):
    """Our stride = seq_len windows are lm-eval's loglikelihood_rolling windows (context_len=1)."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    model, tok = loaded_mha
    seq_len = 16
    ids = tok(known_text, add_special_tokens=False)["input_ids"]
    total = 0.0
    for context, target in map(
        make_disjoint_window,
        get_rolling_token_windows(
            ids, tok.eos_token_id if tok.bos_token_id is None else tok.bos_token_id, seq_len, 1
        ),
    ):
        inputs = torch.tensor([(context + target)[:-1]])
        logits = model(input_ids=inputs).logits[0, -len(target) :]
        total += float(F.cross_entropy(logits.float(), torch.tensor(target), reduction="sum"))
    res = perplexity(model, tok, [known_text], seq_len=seq_len, batch_size=4, progress=False)
    assert res.nll_sum == pytest.approx(total, rel=1e-5)


def test_bits_per_byte_formula_counts_utf8_bytes(loaded_mha, known_text):
    model, tok = loaded_mha
    res = perplexity(model, tok, [known_text], seq_len=32, progress=False)
    n_bytes = len(known_text.encode("utf-8"))
    assert n_bytes > len(known_text)  # the text has multi-byte characters
    assert res.bytes == n_bytes
    assert res.bits_per_byte == pytest.approx(res.nll_sum / (math.log(2) * n_bytes), rel=1e-12)
    assert res.bits_per_byte == pytest.approx(res.nll * res.tokens / n_bytes / math.log(2), rel=1e-9)


def test_documents_are_joined_with_a_blank_line(loaded_mha, known_text):
    model, tok = loaded_mha
    a, b = known_text[:100], known_text[100:]
    joined = perplexity(model, tok, [a + "\n\n" + b], seq_len=32, progress=False)
    split = perplexity(model, tok, [a, b], seq_len=32, progress=False)
    assert split.nll_sum == pytest.approx(joined.nll_sum, rel=1e-6)
    assert split.bytes == joined.bytes and split.documents == 2


def test_deterministic_and_independent_of_batch_size(loaded_mha, known_text):
    model, tok = loaded_mha
    runs = [
        perplexity(model, tok, [known_text], seq_len=16, stride=8, batch_size=b, progress=False)
        for b in (1, 1, 5)
    ]
    assert runs[0].nll_sum == runs[1].nll_sum
    assert runs[2].nll_sum == pytest.approx(runs[0].nll_sum, rel=1e-5)


def test_max_tokens_caps_tokens_and_bytes(loaded_mha, known_text):
    model, tok = loaded_mha
    full = perplexity(model, tok, [known_text], seq_len=16, progress=False)
    capped = perplexity(model, tok, [known_text], seq_len=16, max_tokens=20, progress=False)
    assert capped.tokens == 20 < full.tokens
    assert 0 < capped.bytes < full.bytes


def _byte_fallback_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2's layout): pieces for a b c é and the word boundary ▁,
    ``<0xNN>`` byte tokens for every other character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({piece: 259 + i for i, piece in enumerate("▁abcé")})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize(
    "make, pieces, kept",
    [
        # 日 (3 bytes) and é (2) are unknown to the tiny byte-level BPE: one token per byte
        (tiny_tokenizer, ["a", "b", "æ", "Ĺ", "¥", "Ã", "©", "Ġc"], [1, 2, 3, 4, 5, 6, 7]),
        # byte fallback: 日 as three <0xNN> tokens, é a piece of its own
        (
            _byte_fallback_tokenizer,
            ["a", "b", "<0xE6>", "<0x97>", "<0xA5>", "é", "▁", "c"],
            [1, 2, 3, 4, 5, 7, 8],
        ),
    ],
    ids=["byte-level", "byte-fallback"],
)
def test_max_tokens_counts_the_bytes_of_a_cut_character_it_keeps(make, pieces, kept):
    """A cut inside 日 keeps 1 or 2 of its 3 bytes: bits per byte divides by those, not by 3 (character
    offsets) or by U+FFFD's 3 (decode)."""
    tok = make()
    text = "ab日é c"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == pieces
    for k, n in enumerate(kept, start=1):
        stream, n_bytes = encode_stream(tok, [text], max_tokens=k)
        assert (len(stream) - 1, n_bytes) == (k, n)
    assert encode_stream(tok, [text], max_tokens=len(ids))[1] == len(text.encode("utf-8")) == 9


def test_perplexity_cut_inside_a_character_divides_by_the_bytes_scored(loaded_mha):
    model, tok = loaded_mha
    text = "The cache 日本 shrinks."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids[:5]) == ["The", "Ġc", "ache", "Ġ", "æ"]  # 日's first byte of 3
    res = perplexity(model, tok, [text], seq_len=16, max_tokens=5, progress=False)
    assert res.tokens == 5 and res.bytes == len(b"The cache ") + 1 == 11
    assert res.bits_per_byte == pytest.approx(res.nll_sum / (math.log(2) * 11), rel=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"seq_len": 512}, "more than this model's 256 positions"),
        ({"seq_len": 16, "stride": 17}, "stride between 1 and seq_len 16, got 17"),
        ({"seq_len": 16, "batch_size": 0}, "batch_size and max_tokens must be positive"),
    ],
)
def test_bad_arguments(loaded_mha, kwargs, message, known_text):
    model, tok = loaded_mha
    with pytest.raises(GqakitError, match=message):
        perplexity(model, tok, [known_text], progress=False, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bfloat16_on_cuda_matches_float32_on_cpu(loaded_mha, tiny_models, known_text):
    from gqakit.models import load_causal_lm

    model, tok = loaded_mha
    cpu = perplexity(model, tok, [known_text], seq_len=16, stride=8, batch_size=3, progress=False)
    gpu_model = load_causal_lm(tiny_models["mha"], dtype="bfloat16", device="cuda")
    gpu = perplexity(gpu_model, tok, [known_text], seq_len=16, stride=8, batch_size=3, progress=False)
    assert gpu.tokens == cpu.tokens and gpu.windows == cpu.windows
    assert gpu.ppl == pytest.approx(cpu.ppl, rel=0.02)
