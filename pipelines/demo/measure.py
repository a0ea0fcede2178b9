"""The demo's measurements: settings resolved against the machine, each model's quality and the
exactness checks (the decode speed of all models side by side is in ``decode``). Every result is cached
in a :class:`~gqakit.pipelines.store.ResultStore`, keyed by the settings and the models' fingerprints."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gqakit.eval import DecodePoint, EvalOptions, ModelResult, PerplexityResult, evaluate_models
from gqakit.models import load_causal_lm, load_tokenizer, resolve_device
from gqakit.pipelines.demo.options import KV_TOKENS, DemoOptions
from gqakit.pipelines.reporting import fmt_ppl
from gqakit.pipelines.steps import Steps
from gqakit.pipelines.store import ResultStore, fingerprint

if TYPE_CHECKING:
    from gqakit.eval import EvalOptions, ModelResult
    from gqakit.eval.decode import RoundStats


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
    vllm_stats: RoundStats | None = None  # the same in vLLM, when a Python with vLLM is found
    vllm_kv_tokens: int | None = None  # tokens vLLM's KV cache holds in 1 GiB

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
        """Decode tokens/s at the demo's batch and context (the median round when measured side by side);
        None when that point ran out of memory."""
        if self.decode_stats is not None:
            return self.decode_stats.median
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
            "decode_rounds": list(self.decode_stats.rounds) if self.decode_stats else None,
            "decode_spread": self.decode_stats.spread if self.decode_stats else None,
            "decode_reliable": self.decode_stats.reliable if self.decode_stats else None,
            "llamacpp_rounds": list(self.llamacpp_stats.rounds) if self.llamacpp_stats else None,
            "llamacpp_tokens_per_s": self.llamacpp_stats.median if self.llamacpp_stats else None,
            "vllm_rounds": list(self.vllm_stats.rounds) if self.vllm_stats else None,
            "vllm_tokens_per_s": self.vllm_stats.median if self.vllm_stats else None,
            "vllm_kv_tokens": self.vllm_kv_tokens,
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
        options.decode_batch,
        context,
        options.new_tokens,
        options.decode_rounds,
        ppl_batch=16 if gpu else 4,
    )


def eval_options(s: Settings, test: Path, progress: bool) -> EvalOptions:
    """Capped perplexity per model, with ``gqakit eval``'s own code; the decode point (the grid that
    ``gqakit eval --bench`` would run) is measured later for all models side by side."""
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
    ppl = data.get("perplexity")
    return ModelResult(
        **{
            **data,
            "perplexity": PerplexityResult(**ppl) if ppl else None,
            "decode": [DecodePoint.from_dict(p) for p in data.get("decode", [])],
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

    t0 = time.perf_counter()
    result = evaluate_models({label: str(path)}, options).models[label]
    res = ModelEval(label, result, round(time.perf_counter() - t0, 1))
    store.put(name, key, asdict(res))
    steps.note(
        f"{label}: perplexity {fmt_ppl(res.ppl)}, {res.bits_per_byte:.3f} bits/byte ({res.eval_s:.0f} s)"
    )
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
