"""The llama.cpp engine of ``gqakit eval --engine llamacpp``: measure a checkpoint where GQA's gains are
real.

transformers repeats each shared K/V head for every query head (``repeat_kv``), so its attention reads
as many bytes as MHA; llama.cpp's kernels read a shared head once. This engine exports the checkpoint
to GGUF once (:func:`gqakit.gguf.export.export_gguf`, cached under ``$GQAKIT_CACHE/gguf`` by the
checkpoint's files, the weight type and the exporter's version; a new export replaces the checkpoint's
earlier ones of that type: :func:`gguf_for`), loads it with llama.cpp's Python binding, and fills the same
:class:`~gqakit.eval.results.ModelResult` as the transformers engine:

* perplexity over exactly the transformers engine's windows: the stream is tokenized by the checkpoint's
  own tokenizer (:func:`~gqakit.eval.perplexity.encode_stream`) and cut by
  :func:`~gqakit.eval.perplexity.sliding_windows`; each window's token ids go to llama.cpp, whose
  logits score them. With ``--set gguf_type=f32`` the KV cache is float32 too, so the two engines compute
  the same function;
* decode at each context, batch 1 (the binding's ``Llama`` decodes one sequence): prompt processing
  tokens/s over the context, then the median latency of single-token steps;
* KV-cache bytes as llama.cpp allocates them (its ``llama_kv_cache: size = ...`` log line), beside the
  formula ``2 * layers * kv_heads * head_dim * bytes * cells``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from gqakit import cached_copies
from gqakit.cached_copies import CopyKind, write_record
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
from gqakit.storage import (
    fingerprint,  # noqa: F401 - how the exports are named, read by tests
)

log = logging.getLogger(__name__)

INSTALL = (
    'pip install -e ".[llamacpp]" (it builds llama.cpp from source with the compiler and cmake on the '
    "machine: 5-20 minutes on 2 CPU cores)"
)
GGML_TYPE_F32 = 0  # ggml_type of a float32 KV cache
# llama.cpp logs the cache it allocates: "llama_kv_cache: size =   90.00 MiB (  4096 cells, ...". It
# rounds the cells up (to a multiple of 256), so the cells come from the line, not from n_ctx.
_KV_LINE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells")
CACHE = "gguf"  # the exports' folder under the cache root
# Beside each export, the checkpoint it was exported from: ``<export>.gguf`` + this. Not a ``.gguf`` name,
# so that a listing of the exports leaves it out.
RECORD_SUFFIX = ".source.json"


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

    The export is named by the checkpoint directory's name and fingerprint, the weight type and the
    exporter's version (``_EXPORTS.name``), and records its source beside it (``<export>.source.json``,
    written once the export is complete). Otherwise it is cached as a dequantized ``.gguf`` is
    (:func:`gqakit.cached_copies.cached_copy`): a second process waits for the first's export, and a new
    export removes those it supersedes (an export of the same checkpoint with another weight type is
    another export)."""
    src = Path(path).expanduser().resolve()

    def build(dst: Path, record: dict[str, Any]) -> None:
        # export_gguf writes a temporary file and renames it, so an export there is whole: only its record
        # is missing (a run stopped between the two)
        if not dst.is_file():
            res = export_gguf(src, dst, out_type=out_type, force=True)
            for warning in res.warnings:
                log.warning("%s: %s", src, warning)
        write_record(_record_path(dst), record)

    what = f"exporting {src} to {{copy}}"
    return cached_copies.cached_copy(_EXPORTS, src, build, what, out_type=out_type)


def _record_path(export: Path) -> Path:
    return export.with_name(export.name + RECORD_SUFFIX)


def _remove_export(export: Path) -> int | None:
    """Remove one cached export and its record; the bytes they held, or None when already gone."""
    if not export.is_file():  # another process removed it first
        return None
    record = _record_path(export)
    size = export.stat().st_size + (record.stat().st_size if record.is_file() else 0)
    # the export first: a removal cut short leaves a record without a file, which nothing opens
    export.unlink()
    record.unlink(missing_ok=True)
    return size


# the cache's exports: how cached_copies names, checks and removes one (and its record); through lambdas,
# so that _record_path and EXPORT_VERSION are looked up when called
_EXPORTS = CopyKind(
    folder=CACHE,
    name="{name}-{fp}-{out_type}-e{version}.gguf",
    version_key="export",
    version=lambda: EXPORT_VERSION,
    record=lambda e: _record_path(e),
    complete=lambda e: e.is_file() and _record_path(e).is_file(),
    remove=_remove_export,
    rm=lambda e: f"rm -f {e} {_record_path(e)}",
    described="a GGUF export for llama.cpp",
    log=log,
)


@contextmanager
def _llama_log() -> Iterator[list[str]]:
    """Collect llama.cpp's log lines (it logs the KV cache it allocates) while the block runs; drop them
    afterwards (the per-call lines would flood the terminal)."""
    llama_cpp = require_llama_cpp()
    lines: list[str] = []

    def collect(_level, text, _user_data) -> None:
        lines.append(text.decode(errors="replace"))

    callbacks = [llama_cpp.llama_log_callback(collect), llama_cpp.llama_log_callback(lambda *_: None)]
    _KEEP.extend(callbacks)  # ctypes callbacks must outlive their registration
    llama_cpp.llama_log_set(callbacks[0], ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(callbacks[1], ctypes.c_void_p(0))


_KEEP: list[Any] = []


def _open(gguf: Path, n_ctx: int, f32_kv: bool, logits_all: bool):
    """A ``llama_cpp.Llama`` on ``gguf``, the KV-cache bytes llama.cpp allocated for it (to its log's
    0.01 MiB; None when it did not log them) and the cells they hold."""
    llama_cpp = require_llama_cpp()
    kv = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if f32_kv else {}
    with _llama_log() as lines:
        llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=min(n_ctx, 512),
            n_threads=os.cpu_count() or 1,
            logits_all=logits_all,
            verbose=False,
            **kv,
        )
    found = [m for line in "".join(lines).splitlines() if (m := _KV_LINE.search(line))]
    if not found:
        return llm, None, n_ctx
    return llm, int(round(float(found[-1].group(1)) * 2**20)), int(found[-1].group(2))


def llamacpp_perplexity(gguf: Path, tokenizer, texts: list[str], options: EvalOptions) -> PerplexityResult:
    """Perplexity and bits per byte of the GGUF model over the transformers engine's windows."""
    llm, _, _ = _open(gguf, options.seq_len, f32_kv=True, logits_all=True)

    def score(stream: list[int], windows: list[Window]) -> float:
        nll_sum = 0.0
        for w in windows:
            llm.reset()
            llm.eval(stream[w.start : w.end])
            logits = np.asarray(llm.scores[w.end - w.start - w.scored : w.end - w.start], dtype=np.float64)
            targets = np.asarray(stream[w.end + 1 - w.scored : w.end + 1])
            peak = logits.max(axis=1, keepdims=True)
            logz = np.log(np.exp(logits - peak).sum(axis=1)) + peak[:, 0]
            nll_sum += float((logz - logits[np.arange(len(targets)), targets]).sum())
        return nll_sum

    try:
        return windowed_perplexity(
            tokenizer,
            texts,
            score,
            seq_len=options.seq_len,
            stride=options.stride,
            max_tokens=options.max_tokens,
        )
    finally:
        llm.close()


def llamacpp_decode(
    gguf: Path, geom: AttentionGeometry, contexts: list[int], new_tokens: int, f32_kv: bool, seed: int = 0
) -> tuple[list[DecodePoint], int | None]:
    """One decode point per context, batch 1: prompt processing (random token ids), then ``new_tokens``
    greedy single-token steps, timed one by one. Returns the points and the KV bytes llama.cpp allocated
    (for at least ``max(contexts) + new_tokens`` cells)."""
    n_ctx = max(contexts) + new_tokens
    llm, kv_bytes, cells = _open(gguf, n_ctx, f32_kv=f32_kv, logits_all=False)
    per_token = geom.kv_bytes_per_token(dtype_bytes=4 if f32_kv else 2)
    rng = np.random.default_rng(seed)
    points = []
    try:
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
            points.append(
                DecodePoint(
                    batch=1, context=context, new_tokens=new_tokens, prefill_s=prefill_s, decode_ms=ms,
                    tokens_per_s=1000 / ms, kv_bytes=kv_bytes, kv_bytes_predicted=per_token * cells,
                    kv_tokens=cells,
                )
            )  # fmt: skip
    finally:
        llm.close()
    return points, kv_bytes


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
        points, _ = llamacpp_decode(ggufs[i], geoms[i], [context], new_tokens, False, r)
        return points[0].tokens_per_s

    return interleaved(len(paths), rounds, one)


def _greedy(llm) -> int:
    """The argmax of the last evaluated token's logits (the binding keeps no copy of them unless it was
    opened with ``logits_all``)."""
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
        res.decode, _ = llamacpp_decode(gguf, geom, contexts, options.new_tokens, f32_kv, options.seed)
        for p in res.decode:
            p.bytes_per_step = weight_bytes + res.kv_bytes_per_token * (p.context + options.new_tokens // 2)
    return res
