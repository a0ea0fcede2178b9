"""The llama.cpp engine of ``gqakit eval --engine llamacpp``: measure a checkpoint where GQA's gains are
real.

transformers repeats each shared K/V head for every query head (``repeat_kv``), so its attention reads
as many bytes as MHA; llama.cpp's kernels read a shared head once. This engine exports the checkpoint
to GGUF once (cached: :func:`gguf_for`), loads it with llama.cpp's Python binding and fills the same
:class:`~gqakit.eval.results.ModelResult` as the transformers engine (what it measures: docs/eval.md).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np

from gqakit.checkpoint import read_config
from gqakit.errors import GqakitError
from gqakit.eval.decode import DecodePoint, interleaved
from gqakit.eval.options import EvalOptions
from gqakit.eval.perplexity import PerplexityResult, Window, windowed_perplexity
from gqakit.eval.results import ModelResult
from gqakit.geometry import AttentionGeometry
from gqakit.gguf.export import EXPORT_VERSION, export_gguf
from gqakit.gguf.header import read_gguf_header
from gqakit.models import load_tokenizer
from gqakit.storage import cached_copy, fingerprint, source_folder

log = logging.getLogger(__name__)

INSTALL = (
    'pip install -e ".[llamacpp]" (it builds llama.cpp from source with the compiler and cmake on the '
    "machine: 5-20 minutes on 2 CPU cores)"
)
GGML_TYPE_F32 = 0  # ggml_type of a float32 KV cache
CACHE = "gguf"  # the exports' folder under the cache root


def require_llama_cpp(_options: Any = None):
    """The ``llama_cpp`` module, or one message with the command that installs it."""
    try:
        # deferred: llama.cpp's binding is optional
        import llama_cpp
    except ImportError:
        raise GqakitError(
            f"--engine llamacpp needs llama.cpp's Python binding, which is not installed: {INSTALL}."
        ) from None
    return llama_cpp


def gguf_for(path: str, out_type: str) -> Path:
    """``path`` (a checkpoint directory) exported to GGUF with ``out_type`` weights (``f32``, ``f16`` or
    ``q8_0``), once, into the cache; the cached ``.gguf`` file.

    The export is named by the checkpoint's name and fingerprint, the weight type and the exporter's
    version; otherwise it is cached as a dequantized ``.gguf`` is
    (:func:`gqakit.storage.cached_copy`)."""
    src = Path(path).expanduser().resolve()
    name = f"{src.name}-{fingerprint(src)}-{out_type}-e{EXPORT_VERSION}.gguf"

    def build(dst: Path) -> None:
        export_gguf(src, dst, out_type=out_type, force=True)  # a temporary file renamed into place

    return cached_copy(source_folder(CACHE, src, out_type), name, build, f"exporting {src} to {{copy}}", log)


def _open(gguf: Path, n_ctx: int, f32_kv: bool, logits_all: bool):
    """A ``llama_cpp.Llama`` on ``gguf`` with room for ``n_ctx`` tokens."""
    kv = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if f32_kv else {}
    return require_llama_cpp().Llama(
        model_path=str(gguf),
        n_ctx=n_ctx,
        n_batch=min(n_ctx, 512),
        n_threads=os.cpu_count() or 1,
        logits_all=logits_all,
        verbose=False,
        **kv,
    )


def llamacpp_perplexity(gguf: Path, tokenizer, texts: list[str], options: EvalOptions) -> PerplexityResult:
    """Perplexity and bits per byte of the GGUF model over the transformers engine's windows."""
    llm = _open(gguf, options.seq_len, f32_kv=True, logits_all=True)
    o = options

    def score(stream: list[int], windows: list[Window]) -> float:
        nll_sum = 0.0
        for w in windows:
            llm.reset()
            llm.eval(stream[w.start : w.end])
            logits = np.asarray(llm.scores[w.end - w.start - w.scored : w.end - w.start], dtype=np.float64)
            targets = np.asarray(stream[w.end + 1 - w.scored : w.end + 1])
            logz = np.logaddexp.reduce(logits, axis=1)
            nll_sum += float((logz - logits[np.arange(len(targets)), targets]).sum())
        return nll_sum

    with closing(llm):
        return windowed_perplexity(
            tokenizer, texts, score, seq_len=o.seq_len, stride=o.stride, max_tokens=o.max_tokens
        )


def llamacpp_decode(
    gguf: Path, geom: AttentionGeometry, contexts: list[int], new_tokens: int, f32_kv: bool, seed: int = 0
) -> list[DecodePoint]:
    """One decode point per context, batch 1: prompt processing (random token ids), then ``new_tokens``
    greedy single-token steps, timed one by one; the KV bytes predicted from ``geom``."""
    llm = _open(gguf, max(contexts) + new_tokens, f32_kv=f32_kv, logits_all=False)
    per_token = geom.kv_bytes_per_token(dtype_bytes=4 if f32_kv else 2)
    rng = np.random.default_rng(seed)
    points = []
    with closing(llm):
        vocab = llm.n_vocab()
        llm.reset()
        llm.eval(rng.integers(3, vocab, 8).tolist())  # warm-up: first-call and allocation costs
        for context in contexts:
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(rng.integers(3, vocab, context).tolist())
            prefill_s = time.perf_counter() - t0
            token, steps = _greedy(llm), []
            for _ in range(new_tokens - 1):
                t0 = time.perf_counter()
                llm.eval([token])
                steps.append(time.perf_counter() - t0)
                token = _greedy(llm)
            ms = 1000 * statistics.median(steps)
            kv_tokens = context + new_tokens - 1  # as the hf engine counts: the last token is never fed back
            points.append(
                DecodePoint(
                    batch=1, context=context, new_tokens=new_tokens, prefill_s=prefill_s, decode_ms=ms,
                    tokens_per_s=1000 / ms, kv_bytes_predicted=per_token * kv_tokens, kv_tokens=kv_tokens,
                )
            )  # fmt: skip
    return points


def llamacpp_decode_rounds(
    paths: Sequence[str | Path], *, context: int, new_tokens: int, rounds: int
) -> list[list[float | None]]:
    """Each checkpoint's tokens/s per round in llama.cpp (an f16 GGUF export, cached; batch 1).

    Raises:
        GqakitError: with the install command when llama.cpp's Python binding is missing.
    """
    require_llama_cpp()
    ggufs = [gguf_for(str(p), "f16") for p in paths]
    geoms = [AttentionGeometry.from_config(read_config(Path(p))) for p in paths]

    def one(i: int, r: int) -> float | None:
        return llamacpp_decode(ggufs[i], geoms[i], [context], new_tokens, False, r)[0].tokens_per_s

    return interleaved(len(paths), rounds, one)


def _greedy(llm) -> int:
    """The argmax of the last evaluated token's logits (the binding keeps no copy without ``logits_all``)."""
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))


def measure_llamacpp_model(
    label: str, path: str, *, config: Any, options: EvalOptions, texts: list[str] | None, contexts: list[int]
) -> ModelResult:
    """Export ``path`` to GGUF (cached), measure it in llama.cpp, and return its
    :class:`~gqakit.eval.results.ModelResult` (see the module docstring)."""
    require_llama_cpp()
    start = time.perf_counter()
    gguf = gguf_for(path, options.gguf_type)
    geom = AttentionGeometry.from_config(config.to_dict())
    f32_kv = options.gguf_type == "f32"
    weight_bytes = gguf.stat().st_size

    res = ModelResult.of(
        label, path, geom, parameters=read_gguf_header(gguf).parameters, dtype=f"gguf {options.gguf_type}",
        kv_dtype_bytes=4 if f32_kv else 2, weight_bytes=weight_bytes, load_s=time.perf_counter() - start,
    )  # fmt: skip
    if texts is not None:
        res.perplexity = llamacpp_perplexity(gguf, load_tokenizer(path), texts, options)
    if options.bench:
        res.decode = llamacpp_decode(gguf, geom, contexts, options.new_tokens, f32_kv, options.seed)
        for p in res.decode:
            p.bytes_per_step = weight_bytes + res.kv_bytes_per_token * (p.context + options.new_tokens // 2)
    return res
