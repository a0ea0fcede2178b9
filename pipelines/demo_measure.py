"""The demo's measurements: settings resolved against the machine, each model's quality, the exactness
checks, and the decode speed of all models side by side. Every result is cached in a
:class:`~gqakit.pipelines.store.ResultStore`, keyed by the settings and the models' fingerprints."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gqakit.pipelines.demo_options import KV_TOKENS, DemoOptions
from gqakit.pipelines.reporting import fmt_ppl
from gqakit.pipelines.steps import Steps
from gqakit.pipelines.store import ResultStore, fingerprint

if TYPE_CHECKING:
    from gqakit.eval import EvalOptions, ModelResult


@dataclass
class ModelEval:
    """One row of the table: a model measured by ``gqakit.eval`` (quality, KV cache, decode speed).

    Attributes:
        label: the table's name for it (``MHA-9 (expanded)``, ``MQA (mean), after uptraining``).
        result: what :func:`gqakit.eval.evaluate_models` measured: perplexity, the decode point,
            the attention geometry and the KV bytes per token.
        eval_s: seconds the measurement took.
    """

    label: str
    result: ModelResult
    eval_s: float

    @property
    def kv_heads(self) -> int:
        return self.result.num_kv_heads

    @property
    def ppl(self) -> float:
        return self.result.perplexity.ppl

    @property
    def bits_per_byte(self) -> float:
        return self.result.perplexity.bits_per_byte

    @property
    def tokens(self) -> int:
        return self.result.perplexity.tokens

    @property
    def kv_mib(self) -> float:
        """KV cache of one :data:`KV_TOKENS`-token sequence in the evaluation dtype, MiB."""
        return self.result.kv_bytes_per_token * KV_TOKENS / 2**20

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode tokens/s at the demo's batch and context; None when that point ran out of memory."""
        return self.result.decode[0].tokens_per_s

    def summary(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "path": self.result.path,
            "kv_heads": self.kv_heads,
            "ppl": self.ppl,
            "bits_per_byte": self.bits_per_byte,
            "tokens": self.tokens,
            f"kv_mib_{KV_TOKENS}": self.kv_mib,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "decode": self.result.decode[0].to_dict(),
            "eval_s": self.eval_s,
        }


@dataclass(frozen=True)
class Settings:
    """Options resolved against the machine: what every measurement is keyed by."""

    device: str
    dtype: str
    seq_len: int
    eval_tokens: int | None
    decode_batch: int
    decode_context: int
    new_tokens: int
    decode_rounds: int
    ppl_batch: int  # windows per forward pass


def resolve_settings(options: DemoOptions) -> Settings:
    """The device, dtype, token cap and decode point that ``options`` mean on this machine."""
    from gqakit.models import resolve_device

    device = resolve_device(options.device)
    gpu = device.type == "cuda"
    dtype = options.dtype if options.dtype != "auto" else ("bfloat16" if gpu else "float32")
    eval_tokens = options.eval_tokens if options.eval_tokens is not None else (None if gpu else 8192)
    context = options.decode_context or (2048 if gpu else 512)
    return Settings(
        str(device),
        dtype,
        options.seq_len,
        eval_tokens,
        options.decode_batch,
        context,
        options.new_tokens,
        options.decode_rounds,
        ppl_batch=16 if gpu else 4,
    )


def eval_options(s: Settings, test: Path, progress: bool) -> EvalOptions:
    """Capped perplexity per model, with ``gqakit eval``'s own code; the decode point (the grid that
    ``gqakit eval --bench`` would run) is measured later for all models side by side."""
    from gqakit.eval import EvalOptions

    return EvalOptions(
        ppl_data=str(test),
        seq_len=s.seq_len,
        batch_size=s.ppl_batch,
        max_tokens=s.eval_tokens,
        bench=False,
        batch_sizes=(s.decode_batch,),
        contexts=(s.decode_context,),
        new_tokens=s.new_tokens,
        device=s.device,
        dtype=s.dtype,
        progress=progress,
    )


def _model_result(data: dict[str, Any]) -> ModelResult:
    """A :class:`~gqakit.eval.ModelResult` back from its ``asdict`` form."""
    from gqakit.eval import DecodePoint, ModelResult, PerplexityResult

    ppl = data.get("perplexity")
    return ModelResult(
        **{
            **data,
            "perplexity": PerplexityResult(**ppl) if ppl else None,
            "decode": [DecodePoint(**p) for p in data.get("decode", [])],
        }
    )


def _quality_settings(s: Settings) -> dict[str, Any]:
    """The settings a perplexity result depends on (not the decode point's)."""
    return {k: v for k, v in asdict(s).items() if not k.startswith(("decode_", "new_tokens"))}


def evaluate(
    label: str, path: Path, options: EvalOptions, s: Settings, store: ResultStore, steps: Steps
) -> ModelEval:
    """Measure one checkpoint's quality with :func:`gqakit.eval.evaluate_models`, reused when already
    measured."""
    key = {"path": str(Path(path).resolve()), "files": fingerprint(path), **_quality_settings(s)}
    name = "eval-" + Path(path).name
    cached = store.get(name, key)
    if cached is not None:
        res = ModelEval(label, _model_result({**cached["result"], "label": label}), cached["eval_s"])
        steps.note(f"{label}: cached (perplexity {fmt_ppl(res.ppl)})")
        return res

    from gqakit.eval import evaluate_models

    t0 = time.perf_counter()
    result = evaluate_models({label: str(path)}, options).models[label]
    res = ModelEval(label, result, round(time.perf_counter() - t0, 1))
    store.put(name, key, asdict(res))
    steps.note(
        f"{label}: perplexity {fmt_ppl(res.ppl)}, {res.bits_per_byte:.3f} bits/byte ({res.eval_s:.0f} s)"
    )
    return res


def decode_side_by_side(evals: list[ModelEval], s: Settings, store: ResultStore, steps: Steps) -> None:
    """Measure the decode point of every model in ``evals`` in interleaved rounds and attach each model's
    fastest point to its result.

    Timings taken minutes apart on a shared machine drift more than the differences between the models;
    here every round runs all models back to back (the order rotates per round, so no model always
    follows the same one), and each model's figure is its fastest round: interference from other work
    only ever slows a round down (on this project's shared 2-core CPU, rounds of one model spread by
    up to 30%), so the fastest is the most repeatable estimate, as in ``timeit``.
    """
    key = {
        "models": [
            [e.label, str(Path(e.result.path).resolve()), fingerprint(Path(e.result.path))] for e in evals
        ],
        "pick": "fastest round",
        **asdict(s),
    }
    cached = store.get("decode-side-by-side", key)
    if cached is not None:
        from gqakit.eval import DecodePoint

        for e, point in zip(evals, cached["points"], strict=True):
            e.result.decode = [DecodePoint(**point)]
        steps.note("cached")
        return

    from gqakit.eval import bench_decode
    from gqakit.models import load_causal_lm

    runs: list[list[Any]] = [[] for _ in evals]
    for r in range(s.decode_rounds):
        shift = r % len(evals)
        for i in list(range(shift, len(evals))) + list(range(shift)):
            model = load_causal_lm(evals[i].result.path, dtype=s.dtype, device=s.device)
            runs[i] += bench_decode(
                model,
                batch_sizes=(s.decode_batch,),
                contexts=(s.decode_context,),
                new_tokens=s.new_tokens,
                warmup=1,  # as gqakit eval --bench: allocator and first-call costs out of the timing
                progress=False,
            )
            del model
            if s.device.startswith("cuda"):
                torch.cuda.empty_cache()
    for e, points in zip(evals, runs, strict=True):
        ok = [p for p in points if p.tokens_per_s]
        e.result.decode = [max(ok, key=lambda p: p.tokens_per_s) if ok else points[0]]
        tps = e.decode_tokens_per_s
        rounds = " / ".join(f"{p.tokens_per_s:,.1f}" if p.tokens_per_s else "OOM" for p in points)
        speed = f"{tps:,.1f} tok/s" if tps else "out of memory"
        steps.note(f"{e.label}: {speed} (rounds: {rounds})")
    store.put("decode-side-by-side", key, {"points": [e.result.decode[0].to_dict() for e in evals]})


def max_logit_diff(a: Path, b: Path, texts: list[str], s: Settings, store: ResultStore) -> float:
    """max |logits(a) - logits(b)| on two 128-token rows of the test text, in float32."""
    key = {"a": fingerprint(a), "b": fingerprint(b), "device": s.device}
    name = f"logits-{Path(a).name}-vs-{Path(b).name}"
    cached = store.get(name, key)
    if cached is not None:
        return float(cached["max_abs_diff"])
    from gqakit.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(a)
    ids = tok("\n".join(texts)[:20_000], add_special_tokens=False).input_ids[:256]
    batch = torch.tensor(ids[: len(ids) // 2 * 2]).view(2, -1)
    logits = []
    with torch.inference_mode():
        for path in (a, b):
            model = load_causal_lm(path, dtype="float32", device=s.device)
            logits.append(model(batch.to(model.device)).logits.float().cpu())
            del model
    diff = float((logits[0] - logits[1]).abs().max())
    store.put(name, key, {"max_abs_diff": diff})
    return diff


__all__ = [
    "ModelEval",
    "Settings",
    "decode_side_by_side",
    "eval_options",
    "evaluate",
    "max_logit_diff",
    "resolve_settings",
]
