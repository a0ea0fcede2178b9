"""The demo's decode step: every model's decode speed measured side by side
(:mod:`gqakit.eval.decode`), cached in the demo's result store by the models and the settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gqakit.errors import GqakitError
from gqakit.eval import DecodePoint
from gqakit.eval.decode import decode_rounds, round_stats
from gqakit.eval.llamacpp_engine import INSTALL, llamacpp_decode_rounds, require_llama_cpp
from gqakit.eval.vllm_engine import require_vllm, vllm_decode_rounds
from gqakit.models import device_name, resolve_device
from gqakit.pipelines.steps import Steps
from gqakit.pipelines.store import ResultStore, fingerprint

if TYPE_CHECKING:
    from gqakit.pipelines.demo.measure import ModelEval, Settings


def _measured(store: ResultStore, steps: Steps, name: str, key: dict, measure: Callable[[], dict]) -> dict:
    """The result ``name`` cached for ``key``, else ``measure()`` stored."""
    cached = store.get(name, key)
    if cached is None:
        cached = measure()
        store.put(name, key, cached)
    else:
        steps.note(f"{name}: cached")
    return cached


def _settings(s: Settings, *names: str) -> dict:
    return {k: v for k, v in asdict(s).items() if k in names}


def decode_side_by_side(evals: list[ModelEval], s: Settings, store: ResultStore, steps: Steps) -> None:
    """Measure the decode point of every model in ``evals`` in ``s.decode_rounds`` interleaved rounds and
    attach each model's median point and :class:`~gqakit.eval.decode.RoundStats` to it (cached by
    models and settings)."""
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

    cached = _measured(store, steps, "decode-side-by-side", key, measure)
    for e, raw in zip(evals, cached["points"], strict=True):
        points = [DecodePoint.from_dict(p) for p in raw]
        e.decode_stats = round_stats([p.tokens_per_s for p in points])
        ok = sorted((p for p in points if p.tokens_per_s), key=lambda p: p.tokens_per_s)
        e.result.decode = [ok[(len(ok) - 1) // 2] if ok else points[0]]  # the median round's point
        rounds = " / ".join(f"{p.tokens_per_s:,.1f}" if p.tokens_per_s else "OOM" for p in points)
        steps.note(f"{e.label}: {e.decode_stats.describe()} (rounds: {rounds})")


def llamacpp_side_by_side(evals: list[ModelEval], s: Settings, store: ResultStore, steps: Steps) -> bool:
    """The same rounds in llama.cpp (each model exported to an f16 GGUF once, batch 1 at the demo's
    context), attached as ``llamacpp_stats``; False (and a note with the install command) when the
    binding is not installed."""
    try:
        require_llama_cpp()
    except GqakitError:
        steps.note(f"llama.cpp column skipped: its Python binding is not installed ({INSTALL})")
        return False
    key = {
        "models": [[e.label, fingerprint(Path(e.result.path))] for e in evals],
        "engine": "llama.cpp f16, batch 1",
        **_settings(s, "decode_context", "new_tokens", "decode_rounds"),
        "machine": device_name(torch.device("cpu")),  # llama.cpp decodes on the CPU here
    }

    def measure() -> dict:
        paths = [e.result.path for e in evals]
        args = {"context": s.decode_context, "new_tokens": s.new_tokens, "rounds": s.decode_rounds}
        return {"rounds": llamacpp_decode_rounds(paths, **args)}

    for e, rounds in zip(
        evals, _measured(store, steps, "decode-llamacpp", key, measure)["rounds"], strict=True
    ):
        e.llamacpp_stats = round_stats(rounds)
        steps.note(f"{e.label}: llama.cpp {e.llamacpp_stats.describe()}")
    return True


def vllm_side_by_side(evals: list[ModelEval], s: Settings, store: ResultStore, steps: Steps) -> bool:
    """Every model in vLLM at the demo's batch, context and dtype: its KV capacity in 1 GiB and its rounds
    of output tokens/s, attached as ``vllm_kv_tokens`` and ``vllm_stats``; False (and one note saying how
    to add the column) when no Python with vLLM is found."""
    try:
        require_vllm()
    except GqakitError as e:
        steps.note(f"vLLM column skipped: {e.message}")
        return False
    key = {
        "models": [[e.label, fingerprint(Path(e.result.path))] for e in evals],
        "engine": "vllm, 1 GiB KV",
        **_settings(s, "dtype", "decode_batch", "decode_context", "new_tokens"),
        "rounds": s.decode_rounds,
        "machine": device_name(resolve_device("auto")),  # vLLM takes the GPU when there is one
    }

    def measure() -> dict:
        runs = vllm_decode_rounds(
            [e.result.path for e in evals], batch=s.decode_batch, context=s.decode_context,
            new_tokens=s.new_tokens, rounds=s.decode_rounds, dtype=s.dtype,
        )  # fmt: skip
        return {"kv_tokens": [k for k, _ in runs], "rounds": [r for _, r in runs]}

    cached = _measured(store, steps, "decode-vllm", key, measure)
    for e, kv_tokens, rounds in zip(evals, cached["kv_tokens"], cached["rounds"], strict=True):
        e.vllm_kv_tokens, e.vllm_stats = kv_tokens, round_stats(rounds)
        steps.note(f"{e.label}: vLLM {e.vllm_stats.describe()}, KV capacity {kv_tokens:,} tokens in 1 GiB")
    return True
