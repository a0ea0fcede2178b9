"""The demo's measurements, each cached by the settings and the models' fingerprints: settings resolved
against the machine, each model's quality, the exactness checks and the decode speed side by side."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gqakit.errors import GqakitError
from gqakit.eval import DecodePoint, EvalOptions, ModelResult, PerplexityResult, evaluate_models
from gqakit.eval.decode import RoundStats, decode_rounds, round_stats
from gqakit.eval.llamacpp_engine import INSTALL, llamacpp_decode_rounds, require_llama_cpp
from gqakit.models import device_name, load_causal_lm, load_tokenizer, resolve_device
from gqakit.pipelines.demo.options import DECODE_BATCH, KV_TOKENS, NEW_TOKENS, DemoOptions
from gqakit.pipelines.steps import Steps, fmt_ppl
from gqakit.pipelines.store import ResultStore, fingerprint


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
    decode_stats: RoundStats | None = None  # the side-by-side decode rounds (gqakit.eval.decode)
    llamacpp_stats: RoundStats | None = None  # the same in llama.cpp, when its binding is installed

    @property
    def ppl(self) -> float:
        return self.result.perplexity.ppl

    @property
    def kv_mib(self) -> float:
        """KV cache of one :data:`KV_TOKENS`-token sequence in the evaluation dtype, MiB."""
        return self.result.kv_bytes_per_token * KV_TOKENS / 2**20

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Decode tokens/s at the demo's batch and context: the median of the side-by-side rounds; None
        before they ran, or when that point ran out of memory."""
        return self.decode_stats.median if self.decode_stats else None

    def summary(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "path": self.result.path,
            "kv_heads": self.result.num_kv_heads,
            "ppl": self.ppl,
            "bits_per_byte": self.result.perplexity.bits_per_byte,
            "tokens": self.result.perplexity.tokens,
            f"kv_mib_{KV_TOKENS}": self.kv_mib,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "decode": self.result.decode[0].to_dict(),
            "decode_rounds": list(self.decode_stats.rounds) if self.decode_stats else None,
            "decode_spread": self.decode_stats.spread if self.decode_stats else None,
            "decode_reliable": self.decode_stats.reliable if self.decode_stats else None,
            "llamacpp_rounds": list(self.llamacpp_stats.rounds) if self.llamacpp_stats else None,
            "llamacpp_tokens_per_s": self.llamacpp_stats.median if self.llamacpp_stats else None,
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
        DECODE_BATCH,
        context,
        NEW_TOKENS,
        options.decode_rounds,
        ppl_batch=16 if gpu else 4,
    )


def eval_options(s: Settings, test: Path, progress: bool) -> EvalOptions:
    """Capped perplexity per model, with ``gqakit eval``'s own code (no ``--bench``: the decode point is
    measured later for all models side by side)."""
    return EvalOptions(
        ppl_data=str(test),
        seq_len=s.seq_len,
        batch_size=s.ppl_batch,
        max_tokens=s.eval_tokens,
        device=s.device,
        dtype=s.dtype,
        progress=progress,
    )


def _model_result(data: dict[str, Any]) -> ModelResult:
    """A :class:`~gqakit.eval.ModelResult` back from its ``asdict`` form."""
    ppl = data.get("perplexity")
    return ModelResult(
        **{
            **data,
            "perplexity": PerplexityResult(**ppl) if ppl else None,
            "decode": [DecodePoint.from_dict(p) for p in data.get("decode", [])],
        }
    )


def evaluate(
    label: str, path: Path, options: EvalOptions, s: Settings, store: ResultStore, steps: Steps
) -> ModelEval:
    """Measure one checkpoint's quality with :func:`gqakit.eval.evaluate_models`, reused when already
    measured."""
    quality = {k: v for k, v in asdict(s).items() if not k.startswith(("decode_", "new_tokens"))}
    key = {"path": str(Path(path).resolve()), "files": fingerprint(path), **quality}  # not the decode point
    name = "eval-" + Path(path).name
    cached = store.get(name, key)
    if cached is not None:
        res = ModelEval(label, _model_result({**cached["result"], "label": label}), cached["eval_s"])
        steps.note(f"{label}: cached (perplexity {fmt_ppl(res.ppl)})")
        return res

    t0 = time.perf_counter()
    result = evaluate_models({label: str(path)}, options).models[label]
    res = ModelEval(label, result, round(time.perf_counter() - t0, 1))
    store.put(name, key, asdict(res))
    bpb = result.perplexity.bits_per_byte
    steps.note(f"{label}: perplexity {fmt_ppl(res.ppl)}, {bpb:.3f} bits/byte ({res.eval_s:.0f} s)")
    return res


def max_logit_diff(a: Path, b: Path, texts: list[str], s: Settings, store: ResultStore) -> float:
    """max |logits(a) - logits(b)| on two 128-token rows of the test text, in float32."""

    @torch.inference_mode()
    def measure() -> dict[str, float]:
        tok = load_tokenizer(a)
        ids = tok("\n".join(texts)[:20_000], add_special_tokens=False).input_ids[:256]
        batch = torch.tensor(ids[: len(ids) // 2 * 2]).view(2, -1)
        logits = []
        for path in (a, b):
            model = load_causal_lm(path, dtype="float32", device=s.device)
            logits.append(model(batch.to(model.device)).logits.float().cpu())
            del model
        return {"max_abs_diff": float((logits[0] - logits[1]).abs().max())}

    key = {"a": fingerprint(a), "b": fingerprint(b), "device": s.device}
    return float(store.value(f"logits-{Path(a).name}-vs-{Path(b).name}", key, measure)["max_abs_diff"])


def decode_side_by_side(evals: list[ModelEval], s: Settings, store: ResultStore, steps: Steps) -> None:
    """Measure the decode point of every model in ``evals`` in ``s.decode_rounds`` interleaved rounds and
    attach each model's median point and :class:`~gqakit.eval.decode.RoundStats` to it; then the same rounds
    in llama.cpp (each model exported to an f16 GGUF once, batch 1 at the demo's context) as
    ``llamacpp_stats``, or a note with the install command when its binding is not installed. Cached by
    models, settings and machine."""
    paths = [e.result.path for e in evals]
    key = {
        "models": [
            [e.label, str(Path(p).resolve()), fingerprint(Path(p))] for e, p in zip(evals, paths, strict=True)
        ],
        "pick": "median of interleaved rounds",
        **asdict(s),
        "machine": device_name(resolve_device(s.device)),  # another GPU or CPU model times again
    }

    def measure() -> dict:
        points = decode_rounds(
            paths, batch=s.decode_batch, context=s.decode_context, new_tokens=s.new_tokens,
            rounds=s.decode_rounds, dtype=s.dtype, device=s.device,
        )  # fmt: skip
        return {"points": [[p.to_dict() for p in ps] for ps in points]}

    cached = store.value("decode-side-by-side", key, measure)
    for e, raw in zip(evals, cached["points"], strict=True):
        points = [DecodePoint.from_dict(p) for p in raw]
        e.decode_stats = round_stats([p.tokens_per_s for p in points])
        ok = sorted((p for p in points if p.tokens_per_s), key=lambda p: p.tokens_per_s)
        e.result.decode = [ok[(len(ok) - 1) // 2] if ok else points[0]]  # the median round's point
        rounds = " / ".join(f"{p.tokens_per_s:,.1f}" if p.tokens_per_s else "OOM" for p in points)
        steps.note(f"{e.label}: {e.decode_stats.describe()} (rounds: {rounds})")
    try:
        require_llama_cpp()
    except GqakitError:
        steps.note(f"llama.cpp column skipped: its Python binding is not installed ({INSTALL})")
        return
    key = {
        "models": [[e.label, fingerprint(Path(p))] for e, p in zip(evals, paths, strict=True)],
        "engine": "llama.cpp f16, batch 1",
        **{k: getattr(s, k) for k in ("decode_context", "new_tokens", "decode_rounds")},
        "machine": device_name(torch.device("cpu")),  # llama.cpp decodes on the CPU here
    }
    args = {"context": s.decode_context, "new_tokens": s.new_tokens, "rounds": s.decode_rounds}
    llama = store.value("decode-llamacpp", key, lambda: {"rounds": llamacpp_decode_rounds(paths, **args)})
    for e, rounds in zip(evals, llama["rounds"], strict=True):
        e.llamacpp_stats = round_stats(rounds)
        steps.note(f"{e.label}: llama.cpp {e.llamacpp_stats.describe()}")
