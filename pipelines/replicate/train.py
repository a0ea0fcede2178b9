"""The cached steps of ``gqakit replicate``: tokenizer, random initialisation, training runs, conversions,
perplexity and decode time, each keyed by its settings and the fingerprints of the checkpoints it reads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gqakit.checkpoint import read_config
from gqakit.convert import convert_checkpoint
from gqakit.eval import perplexity
from gqakit.eval.decode import decode_rounds, round_stats
from gqakit.geometry import AttentionGeometry
from gqakit.models import device_name, load_causal_lm, load_tokenizer, resolve_device
from gqakit.pipelines.replicate.options import DECODE_ROUNDS, EVAL_TOKENS, UPTRAIN_LR, ReplicateOptions
from gqakit.pipelines.starts import conversion_key, convert_options_for
from gqakit.pipelines.steps import Steps, train_once, weights_key
from gqakit.pipelines.store import ResultStore, fingerprint
from gqakit.storage import atomic_output_dir
from gqakit.text import load_texts
from gqakit.uptrain import load_recipe, recipe_from_dict

SPECIAL = ["<unk>", "<s>", "</s>"]


@dataclass
class Context:
    """What every step needs: the options, the result store, step printing, where models go, the text."""

    o: ReplicateOptions
    store: ResultStore
    steps: Steps
    models: Path
    train: Path
    validation: Path
    test: Path


def train_tokenizer(ctx: Context) -> Path:
    """A byte-level BPE of ``vocab`` tokens trained on the train split (one document per line)."""
    dst = ctx.models / "tokenizer"
    key = {"train": fingerprint(ctx.train), "vocab": ctx.o.model.vocab}

    def build() -> None:
        # deferred: transformers takes seconds to import
        from tokenizers import ByteLevelBPETokenizer
        from transformers import PreTrainedTokenizerFast

        bpe = ByteLevelBPETokenizer()
        lines = ctx.train.read_text(encoding="utf-8").splitlines()
        bpe.train_from_iterator(
            lines, vocab_size=ctx.o.model.vocab, special_tokens=SPECIAL, show_progress=False
        )
        tok = PreTrainedTokenizerFast(
            tokenizer_object=bpe._tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
        )
        with atomic_output_dir(dst, force=True) as tmp:
            tok.save_pretrained(tmp)

    if not ctx.store.build_once(dst, key, build):
        ctx.steps.note(f"reusing {dst}")
    return dst


def model_config(o: ReplicateOptions, kv_heads: int) -> dict[str, Any]:
    """The config of the Llama-architecture model pretrained here, with ``kv_heads`` K/V heads (= heads:
    MHA)."""
    m = o.model
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": m.vocab,
        "hidden_size": m.hidden,
        "intermediate_size": m.intermediate,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": m.seq_len,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }


def init_model(ctx: Context, tokenizer: Path, kv_heads: int, seed: int) -> Path:
    """A randomly initialised checkpoint (transformers' own init, seeded) with the tokenizer."""
    dst = ctx.models / f"init-g{kv_heads}-s{seed}"
    cfg = model_config(ctx.o, kv_heads)
    key = {"config": cfg, "seed": seed, "tokenizer": fingerprint(tokenizer)}

    def build() -> None:
        # deferred: transformers takes seconds to import
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        config = AutoConfig.for_model(**cfg)
        model = AutoModelForCausalLM.from_config(config)
        with atomic_output_dir(dst, force=True) as tmp:
            model.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(tokenizer).save_pretrained(tmp)

    ctx.store.build_once(dst, key, build)
    return dst


def recipe_data(ctx: Context, start: Path, out: Path, steps: int, seed: int, uptraining=False) -> dict:
    """The recipe of one run: ``recipes/replicate-mha.yaml`` (the LM objective on the train split,
    warmup then cosine, checkpoints every 100 steps) with this run's start, steps, seed and sizes; an
    ``uptraining`` run at :data:`UPTRAIN_LR` with the ``--set`` overrides, a pretraining run at the recipe's
    rate."""
    o = ctx.o
    recipe = load_recipe(
        "replicate-mha",
        [
            f"model.path={json.dumps(str(start))}",
            f"data.files={json.dumps([str(ctx.train)])}",
            f"data.val_files={json.dumps([str(ctx.validation)])}",
            f"data.seq_len={o.model.seq_len}",
            f"budget.steps={steps}",
            f"budget.pretraining_tokens={o.pretrain_tokens}",
            f"train.batch_size={o.batch_size}",
            f"log.progress={json.dumps(o.progress)}",
            f"output_dir={json.dumps(str(out))}",
            f"seed={seed}",
            f"speed.device={json.dumps(o.device)}",  # where the conversions and measurements run too
            *([f"train.lr={UPTRAIN_LR}", *o.recipe_sets] if uptraining else ()),
        ],
    )
    return recipe.to_dict()


def train_run(ctx: Context, start: Path, out: Path, steps: int, seed: int, uptraining=False) -> dict:
    """Train ``start`` for ``steps`` steps into ``out`` with gqakit's loop; cached, resumed when killed
    (:func:`~gqakit.pipelines.steps.train_once`: a run killed on one --device resumes on another)."""
    recipe = recipe_from_dict(recipe_data(ctx, start, out, steps, seed, uptraining))
    key = {"start": fingerprint(start), "recipe": weights_key(recipe.to_dict())}
    summary, reused = train_once(ctx.store, "train-" + out.name, recipe, key)
    if reused:
        ctx.steps.note(f"reusing {out.name} ({summary['steps']} steps)")
    else:
        ctx.steps.note(
            f"{out.name}: {summary['steps']} steps, {summary['tokens']:,} tokens, validation "
            f"{summary['final_val_ppl']:,.2f}"
        )
    return summary


def convert_arm(ctx: Context, mha: Path, start: str, groups: int) -> Path:
    """``mha`` converted to ``groups`` K/V heads from ``start`` (a preset or a method)."""
    o = ctx.o
    opts = convert_options_for(start, groups, calib_data=str(ctx.train), sets=o.sets, device=o.device)
    dst = ctx.models / f"start-g{groups}-{start}"
    key = {"source": fingerprint(mha), "options": conversion_key(opts)}
    ctx.store.build_once(dst, key, lambda: convert_checkpoint(mha, dst, opts, progress=o.progress))
    return dst


def perplexity_of(ctx: Context, path: Path) -> float:
    """Test perplexity of one checkpoint on the first :data:`EVAL_TOKENS` test tokens (cached). Keyed by the
    device's kind (what ``auto`` means on this machine), not its model: float32 on two GPU models differs
    by rounding only (the report gives two decimals), while a CPU and a GPU run other kernels."""
    key = {
        "model": fingerprint(path), "test": fingerprint(ctx.test), "tokens": EVAL_TOKENS,
        "device": str(resolve_device(ctx.o.device)),
    }  # fmt: skip

    def measure() -> dict[str, float]:
        model = load_causal_lm(path, dtype="float32", device=ctx.o.device)
        texts = load_texts(ctx.test)
        res = perplexity(
            model,
            load_tokenizer(path),
            texts,
            seq_len=ctx.o.model.seq_len,
            max_tokens=EVAL_TOKENS,
            progress=False,
        )
        return {"ppl": res.ppl, "tokens": res.tokens}

    return ctx.store.value("ppl-" + path.name, key, measure)["ppl"]


def decode_times(ctx: Context, by_g: dict[int, Path]) -> dict[int, dict[str, Any]]:
    """Decode time per token (batch 8, the model's full context, interleaved rounds) and KV bytes per
    token (float32) of one model per G."""
    key = {str(g): fingerprint(p) for g, p in by_g.items()}
    # the device's model, not its kind: timings from one GPU (or CPU) are not another's, so a working
    # directory moved to another one times again
    key |= {"rounds": DECODE_ROUNDS, "device": device_name(resolve_device(ctx.o.device))}

    def measure() -> dict[str, list[float | None]]:
        points = decode_rounds(
            list(by_g.values()), batch=8, context=ctx.o.model.seq_len - 16, new_tokens=16,
            rounds=DECODE_ROUNDS, dtype="float32", device=ctx.o.device,
        )  # fmt: skip
        return {str(g): [p.tokens_per_s for p in ps] for g, ps in zip(by_g, points, strict=True)}

    cached = ctx.store.value("decode", key, measure)
    out = {}
    for g, path in by_g.items():
        stats = round_stats(cached[str(g)])
        geom = AttentionGeometry.from_config(read_config(path))
        ms = 1000 / stats.median if stats.median else None
        out[g] = {"ms_per_token": ms, "spread": stats.spread, "reliable": stats.reliable,
                  "kv_bytes_per_token": geom.kv_bytes_per_token(dtype_bytes=4)}  # fmt: skip
    return out
