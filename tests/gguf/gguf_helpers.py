"""Helpers of the GGUF tests: tiny checkpoints of every exportable family with either kind of tokenizer
the exporter embeds, and reading a written GGUF back with gguf-py's own reader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Per family: config overrides that make a tiny model realistic for llama.cpp. Gemma-family models
# tie their output to the embedding (llama.cpp's gemma/gemma2 have no output tensor) and get head_dim 16
# (= query_pre_attn_scalar of the tiny configs), since transformers' default 256 is meant for 2B+ models.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "gemma": {"head_dim": 16, "tie_word_embeddings": True},
    "gemma2": {"head_dim": 16, "tie_word_embeddings": True},
    "gemma3_text": {"head_dim": 16, "tie_word_embeddings": True},
    "phi3": {},
}
# Short directory names; none contains "phi3" or "phi-3", by which llama.cpp applies Phi-3 token
# fix-ups (it looks tokens up by text and aborts on a vocabulary without them).
SHORT = {"llama": "lla", "mistral": "mis", "qwen2": "qw2", "gemma": "gm1", "gemma2": "gm2",
         "gemma3_text": "gm3", "phi3": "ph3"}  # fmt: skip
# MHA, GQA and MQA forms of a 4-query-head model.
FORMS = {"mha": 4, "gqa": 2, "mqa": 1}
SPM_VOCAB = 448  # embedding rows for models with the SentencePiece-style tokenizer below


def spm_tokenizer(prepend_space: bool = False, add_bos: bool = True):
    """A byte-fallback BPE tokenizer laid out like Gemma's and Llama 2's ``tokenizer.json``.

    ids 0-3 are ``<pad> <eos> <bos> <unk>``, 4-259 the byte tokens ``<0x00>``..``<0xFF>``, then the pieces
    of a BPE trained on :data:`tiny_models.TINY_TEXT` with spaces written as ``▁``. With
    ``prepend_space`` it also puts a ``▁`` before the text (Llama 2); Gemma does not.
    """
    from tiny_models import TINY_TEXT
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    space = "\u2581"
    # trained on words that start with ▁, as SentencePiece pieces do; the tokenizer itself, like
    # Llama 2's and Gemma's tokenizer.json, then has no pre-tokenizer
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(space, prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=160, show_progress=False)
    trainer_tok.train_from_iterator([TINY_TEXT] * 4, trainer)
    trained = trainer_tok.get_vocab()
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    pieces = specials + [f"<0x{i:02X}>" for i in range(256)]
    pieces += sorted(trained, key=trained.get)
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [tuple(m) for m in json.loads(trainer_tok.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Prepend(space)] if prepend_space else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", space)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prepend_space else [])
    )
    tok.add_special_tokens(specials)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )


def make_checkpoint(
    root: Path, family: str, kv_heads: int, tokenizer: str = "bpe", seed: int = 0, **overrides: Any
) -> Path:
    """Save a tiny random ``family`` model with ``kv_heads`` K/V heads (4 query heads) and a tokenizer.

    Args:
        tokenizer: ``bpe`` (gqakit's byte-level tiny tokenizer), ``spm`` (Gemma-style byte-fallback),
            ``spm-prefix`` (Llama-2-style, prepends a space) or ``none``.
    """
    from tiny_models import save_tiny_model

    kw = {**FAMILIES[family], **overrides}
    path = root / f"m-{SHORT[family]}-{kv_heads}-{tokenizer}"
    if tokenizer == "bpe":
        return save_tiny_model(path, family, seed=seed, heads=4, kv_heads=kv_heads, **kw)
    kw.setdefault("vocab_size", SPM_VOCAB)
    save_tiny_model(path, family, seed=seed, tokenizer=False, heads=4, kv_heads=kv_heads,
                    bos_token_id=2, eos_token_id=1, pad_token_id=0, **kw)  # fmt: skip
    if tokenizer != "none":
        spm_tokenizer(prepend_space=tokenizer == "spm-prefix").save_pretrained(path)
    return path


def read_gguf(path: Path) -> tuple[dict[str, np.ndarray], dict[str, tuple[str, tuple[int, ...]]], dict]:
    """A GGUF read with ``gguf.GGUFReader``: name -> values (dequantized, numpy order), name -> (type,
    GGUF ``ne`` shape), and key -> value."""
    import gguf

    reader = gguf.GGUFReader(path)
    values, infos = {}, {}
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = gguf.quants.dequantize(data, t.tensor_type)
        values[t.name] = data.astype(np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
        infos[t.name] = (t.tensor_type.name, tuple(int(d) for d in t.shape))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return values, infos, fields


def legacy_gemma3_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A transformers 5 ``gemma3_text`` config in the form transformers 4.50-4.52 wrote (the released
    Gemma 3 checkpoints): ``rope_theta``, ``rope_local_base_freq``, ``rope_scaling`` (full-attention
    layers only) and ``sliding_window_pattern`` in place of ``rope_parameters`` and ``layer_types``."""
    cfg = dict(cfg)
    rope, kinds = cfg.pop("rope_parameters"), cfg.pop("layer_types")
    cfg.pop("_sliding_window_pattern", None)
    full = dict(rope["full_attention"])
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    cfg["rope_scaling"] = None if full["rope_type"] == "default" else full
    cfg["sliding_window_pattern"] = kinds.index("full_attention") + 1 if "full_attention" in kinds else 6
    return cfg


def ggml_to_hf_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``hf_to_ggml_rotary``: GGUF llama rows back to Hugging Face's layout."""
    d = w.shape[0] // n_heads
    pairs = w.reshape(n_heads, d // 2, 2, *w.shape[1:])
    return pairs.transpose(1, 2).reshape(w.shape)
