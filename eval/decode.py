"""Decode speed and KV-cache memory over a grid of (batch, context), timed with ``generate`` (what each
figure is: docs/eval.md); a point that runs out of memory is recorded as such and the grid goes on.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from gqakit.cli_options import parse_list
from gqakit.console import progress as progress_bar
from gqakit.errors import GqakitError
from gqakit.eval.kv_bytes import cache_geometry, measured_kv_bytes, predicted_kv_bytes, weight_bytes_per_step
from gqakit.models import load_causal_lm, release_memory, resolve_device

log = logging.getLogger(__name__)


@dataclass
class DecodePoint:
    """One (batch, context) point of the decode grid."""

    batch: int  # sequences decoded together.
    context: int  # prompt tokens per sequence.
    new_tokens: int  # tokens generated per sequence.
    status: str = "ok"  # ``"ok"`` or ``"oom"``.
    prefill_s: float | None = None  # seconds from the call to the first logits.
    decode_ms: float | None = None  # median per-step latency, milliseconds.
    # decoded tokens per second over the batch (``batch * 1000 / decode_ms``).
    tokens_per_s: float | None = None
    kv_bytes: int | None = None  # bytes of every K and V tensor in the cache object after generating.
    kv_bytes_predicted: int = 0  # ``2 * layers * batch * kv_heads * kv_tokens * head_dim * dtype bytes``.
    kv_tokens: int = 0  # tokens the cache holds (or is allocated for, with a static cache).
    bytes_per_step: int = 0  # weight bytes + KV bytes at the mean decode position (see ``kv_bytes``).
    static_cache: bool = False  # a static cache was used.
    error: str | None = None  # the error message of an OOM point.
    # tokens/s of each round, when the point was measured in rounds (the vLLM engine).
    rounds: list[float | None] | None = None
    spread: float | None = None  # ``(max - min) / median`` of the rounds.
    # the rounds agree (see :func:`round_stats`); no speedup is computed from an unreliable point.
    reliable: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DecodePoint:
        """A point back from :meth:`to_dict`, keys of older versions (``compiled``) left out."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def free_memory(device: str | torch.device) -> None:
    """Collect the freed tensors and give their memory back (:func:`gqakit.models.release_memory`: to the
    GPU's free memory, where the next model or engine sizes itself)."""
    gc.collect()
    release_memory(resolve_device(str(device)))


def _prompts(model, batch: int, context: int, seed: int, device: torch.device) -> torch.Tensor:
    """Random token ids that avoid the special tokens (so nothing in the prompt is padding or EOS)."""
    cfg = model.config
    specials = [getattr(cfg, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id")]
    flat = [t for s in specials for t in (s if isinstance(s, list) else [s]) if isinstance(t, int)]
    low = max(flat, default=-1) + 1
    vocab = model.get_input_embeddings().weight.shape[0]
    low = low if low < vocab - 1 else 0
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (batch, context), generator=gen).to(device)


def _random_cache(model, batch: int, tokens: int, static_len: int | None):
    """A cache already holding ``tokens`` random keys and values per layer (``static_len``: a static cache
    of that many slots, else a dynamic one); with ``tokens`` 0, an empty one."""
    # deferred: transformers takes seconds to import
    from transformers import DynamicCache, StaticCache

    g = cache_geometry(model.config)  # the heads the cache holds (Falcon's new layout: H)
    param = next(model.parameters())
    cache = (
        StaticCache(config=model.config, max_cache_len=static_len)
        if static_len
        else DynamicCache(config=model.config)
    )
    # Drawn on the model's device: on a GPU, gigabytes of CPU random numbers would take longer than
    # the decode they stand in for.
    gen = torch.Generator(device=param.device).manual_seed(0)
    position = {"cache_position": torch.arange(tokens, device=param.device)}
    shape = (batch, g.num_kv_heads, tokens, g.head_dim)
    for layer in range(g.num_layers if tokens else 0):
        k, v = (torch.randn(shape, generator=gen, device=param.device, dtype=param.dtype) for _ in range(2))
        cache.update(k, v, layer, position)
    return cache


def cache_kwarg() -> str:
    """What ``generate`` and a model's forward call a cache passed in: ``cache`` from transformers 5.24 on
    (which warns that ``past_key_values`` goes away in 5.40), ``past_key_values`` before (which does not
    know ``cache``)."""
    # deferred: transformers takes seconds to import
    import transformers
    from packaging.version import Version

    return "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def _generate_once(model, prompts: torch.Tensor, new_tokens: int, static_cache: bool, prefill: str = "model"):
    """One timed ``generate``: returns (prefill s, per-step latencies s, cache object)."""
    # deferred: transformers takes seconds to import
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

    device = prompts.device
    stamps: list[float] = []

    class _Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            _sync(device)
            stamps.append(time.perf_counter())
            return scores

    cfg = model.config
    gen_cfg = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=cfg.pad_token_id if cfg.pad_token_id is not None else 0,
        eos_token_id=cfg.eos_token_id,
        disable_compile=True,  # a static cache would otherwise be compiled on a GPU
        return_dict_in_generate=True,
    )
    kwargs = {}
    if prefill == "random" or static_cache:
        # "random": all but the last prompt token are already "in" the cache, and generate() feeds only the
        # last one. A static cache is our own object, sized for this point: generate() would otherwise reuse
        # (and keep growing) one static cache across calls, and the measured bytes would not be this point's.
        filled = prompts.shape[1] - 1 if prefill == "random" else 0
        slots = prompts.shape[1] + new_tokens - 1 if static_cache else None
        kwargs[cache_kwarg()] = _random_cache(model, prompts.shape[0], filled, slots)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        generation_config=gen_cfg,
        logits_processor=LogitsProcessorList([_Stamp()]),
        **kwargs,
    )
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return stamps[0] - start, steps, out.past_key_values


def parse_grid(value: str | Sequence[int], name: str) -> tuple[int, ...]:
    """``"1,8,32"`` -> (1, 8, 32): positive, no duplicates; otherwise a GqakitError naming ``name``."""
    value = value if isinstance(value, str) else ",".join(map(str, value))  # as the user wrote it
    nums = list(parse_list(value, int, name))
    if not nums:
        raise GqakitError(f"{name} is empty; give at least one number.")
    bad = [n for n in nums if n <= 0]
    if bad:
        raise GqakitError(f"{name} {value!r} has non-positive values {bad}; every value must be >= 1.")
    if len(set(nums)) != len(nums):
        raise GqakitError(f"{name} {value!r} repeats a value.")
    return tuple(nums)


@torch.inference_mode()
def bench_decode(
    model,
    *,
    batch_sizes: Sequence[int],
    contexts: Sequence[int],
    new_tokens: int = 32,
    warmup: int = 1,
    static_cache: bool = False,
    progress: bool = True,
    seed: int = 0,
    prefill: str = "model",
) -> list[DecodePoint]:
    """Measure prefill time, decode latency and KV-cache bytes at every (batch, context).

    Args:
        model: a causal LM on the device to measure.
        batch_sizes: batch sizes of the grid.
        contexts: prompt lengths of the grid.
        new_tokens: tokens generated per point (>= 2; the first is the prefill's).
        warmup: untimed runs before each timed point, of the same shape (compiles, fills allocators).
        static_cache: use a preallocated ``StaticCache`` instead of the growing ``DynamicCache``.
        progress: show a progress bar.
        seed: seed of the random prompts.
        prefill: ``"model"`` runs the prompt through the model and times it; ``"random"`` fills the cache
            with random keys and values instead (``prefill_s`` is then None). A decode step costs the
            same either way (attention reads every cached key and value whatever they hold), so
            ``"random"`` measures long contexts on a CPU without minutes of prefill per point.

    Returns:
        One :class:`DecodePoint` per (batch, context), batch-major.
    """
    batch_sizes, contexts = parse_grid(batch_sizes, "batch_sizes"), parse_grid(contexts, "contexts")
    if new_tokens < 2 or warmup < 0 or prefill not in ("model", "random"):
        raise GqakitError(
            "bench_decode needs new_tokens >= 2 (a prefill token and a decode step), warmup >= 0 and prefill "
            f"'model' or 'random', got {new_tokens}, {warmup} and {prefill!r}."
        )
    grid = [(b, c) for b in batch_sizes for c in contexts]
    return [
        _point(model, b, c, new_tokens, warmup, static_cache, seed, prefill)
        for b, c in progress_bar(grid, "decode", enabled=progress, unit="pt")
    ]


def _point(model, b: int, c: int, new_tokens, warmup, static_cache, seed, prefill) -> DecodePoint:
    """One point of :func:`bench_decode`: batch ``b``, context ``c``."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    kv_tokens = c + new_tokens - 1  # the last generated token is never fed back
    point = DecodePoint(
        batch=b, context=c, new_tokens=new_tokens, static_cache=static_cache, kv_tokens=kv_tokens,
        kv_bytes_predicted=predicted_kv_bytes(model.config, b, kv_tokens, dtype, static_cache),
        bytes_per_step=weight_bytes_per_step(model)
        + predicted_kv_bytes(model.config, b, c + new_tokens // 2, dtype, static_cache),
    )  # fmt: skip
    try:
        prompts = _prompts(model, b, c, seed, device)
        for _ in range(warmup):
            _generate_once(model, prompts, new_tokens, static_cache, prefill)
        first_s, steps, cache = _generate_once(model, prompts, new_tokens, static_cache, prefill)
        point.prefill_s = first_s if prefill == "model" else None
        latency = statistics.median(steps)
        point.decode_ms = latency * 1e3
        point.tokens_per_s = b / latency
        point.kv_bytes = measured_kv_bytes(cache)
        del cache
    except Exception as e:
        if not _is_oom(e):
            raise
        point.status, point.error = "oom", str(e).splitlines()[0][:200]
        log.warning("decode batch=%d context=%d: out of memory; recorded as OOM", b, c)
    finally:
        free_memory(device)
    return point


# Side by side: a background job that starts or stops while models are measured one after another can fake
# a speedup of any size (a loaded machine once showed MHA-9 at 2.9 tokens/s and MQA at 49.8, "16.96x"). So
# every model is loaded once, and each short round runs every model back to back, in an order that rotates
# from round to round (``gqakit demo``, ``gqakit replicate``). A model's figure is the median of its rounds;
# when their spread ``(max - min) / median`` exceeds DECODE_TOLERANCE it is unreliable and gives no speedup:
# on a quiet 2-core CPU rounds of one model spread by under 10%; a job starting mid-measurement, by more.
DECODE_TOLERANCE = 0.25


@dataclass(frozen=True)
class RoundStats:
    """A model's decode rounds (tokens/s; None for a round that ran out of memory) and their summary."""

    rounds: tuple[float | None, ...]  # tokens/s of each round, in the order measured.
    median: float | None  # the median round (None when every round ran out of memory).
    spread: float | None  # ``(max - min) / median`` over the rounds.
    reliable: bool  # the spread is within the tolerance (and some round ran).

    def describe(self) -> str:
        if self.median is None:
            return "out of memory"
        text = f"{self.median:,.1f} tok/s, spread {100 * (self.spread or 0):.0f}%"
        return text if self.reliable else text + " (unreliable: the load changed during the measurement)"


def round_stats(rounds: Sequence[float | None], tolerance: float = DECODE_TOLERANCE) -> RoundStats:
    """Summarize one model's rounds: median, spread, and whether the spread is within ``tolerance``."""
    ran = [r for r in rounds if r]
    if not ran:
        return RoundStats(tuple(rounds), None, None, False)
    med = statistics.median(ran)
    spread = (max(ran) - min(ran)) / med
    return RoundStats(tuple(rounds), med, spread, spread <= tolerance and len(ran) == len(rounds))


def speedup(row: RoundStats | None, base: RoundStats | None) -> str:
    """A table's speedup cell: the ratio of medians, or why there is none."""
    if row is None or base is None or row.median is None or base.median is None:
        return "-"
    if not (row.reliable and base.reliable):
        return "unreliable"
    return f"{row.median / base.median:.2f}x"


def interleaved(n_models: int, rounds: int, measure: Callable[[int, int], Any]) -> list[list[Any]]:
    """``measure(model, round)`` for every model in every round, the order rotating by one model per
    round; returns each model's results in round order."""
    runs: list[list[Any]] = [[] for _ in range(n_models)]
    for r in range(rounds):
        for i in [(r + k) % n_models for k in range(n_models)]:
            runs[i].append(measure(i, r))
    return runs


def decode_rounds(
    paths: Sequence[str | Path],
    *,
    batch: int,
    context: int,
    new_tokens: int,
    rounds: int,
    dtype: str = "auto",
    device: str = "auto",
) -> list[list[Any]]:
    """Each checkpoint's :class:`~gqakit.eval.decode.DecodePoint` per round, in transformers.

    Every model is loaded once; the first round of each model has one untimed warmup (first-call and
    allocator costs). The cache is filled with random keys and values (``prefill="random"``): a decode
    step reads every cached entry whatever it holds, and no round pays for a prompt.
    """
    models = [load_causal_lm(p, dtype=dtype, device=device) for p in paths]

    def one(i: int, r: int) -> Any:
        return bench_decode(
            models[i], batch_sizes=(batch,), contexts=(context,), new_tokens=new_tokens,
            warmup=1 if r == 0 else 0, progress=False, prefill="random",
        )[0]  # fmt: skip

    try:
        return interleaved(len(models), rounds, one)
    finally:
        models.clear()  # the caller's cache gets the memory back before anything else loads
        free_memory(device)
