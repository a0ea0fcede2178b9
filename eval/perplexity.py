"""Sliding-window perplexity and bits per byte over a corpus, batched, without gradients.

Every engine scores the same windows of one prefixed token stream (:func:`sliding_windows`, drawn in
docs/eval.md): every token once, and all windows of ``seq_len`` inputs, so they batch without padding.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gqakit.console import progress as progress_bar
from gqakit.errors import GqakitError
from gqakit.eval.kept_bytes import kept_bytes
from gqakit.models import check_seq_len
from gqakit.text import DOC_SEPARATOR


@dataclass
class PerplexityResult:
    """Perplexity of one model on one corpus."""

    ppl: float  # perplexity, ``exp(nll)``.
    nll: float  # mean negative log-likelihood per token, nats.
    bits_per_byte: float  # ``nll_sum / (ln 2 * bytes)``; tokenizer-independent.
    tokens: int  # scored tokens.
    bytes: int  # UTF-8 bytes of the scored text.
    seq_len: int  # tokens per window.
    stride: int  # new tokens scored per window after the first.
    nll_sum: float = 0.0  # total negative log-likelihood, nats.
    windows: int = 0  # forward passes (window count).
    documents: int = 0  # documents joined into the stream.
    elapsed_s: float = 0.0  # wall time of the forward passes and scoring.
    tokens_per_s: float = 0.0  # scored tokens per second.


@dataclass(frozen=True)
class Window:
    """One forward pass: inputs ``stream[start:end]``, scoring its last ``scored`` predictions."""

    start: int
    end: int
    scored: int


def sliding_windows(n: int, seq_len: int, stride: int) -> list[Window]:
    """The windows over a stream of ``n`` tokens (prefix included); see the module docstring.

    The predictions of ``stream[start:end]`` are ``stream[start+1:end+1]``; the window scores the last
    ``scored`` of them. Together the windows score ``stream[1:n]`` exactly once.
    """
    if seq_len < 1 or not 1 <= stride <= seq_len:
        raise GqakitError(f"Need seq_len >= 1 and stride between 1 and seq_len {seq_len}, got {stride}.")
    if n < 2:
        return []
    first = min(seq_len, n - 1)  # targets 1..first
    windows = [Window(0, first, first)]
    for done in range(first, n - 1, stride):
        end = min(done + stride, n - 1)  # the last input predicts target ``end``
        windows.append(Window(max(0, end - seq_len), end, end - done))
    return windows


def prefix_token_id(tokenizer) -> int:
    """BOS, else EOS: the token put before the text so its first token can be scored (lm-eval's rule)."""
    tok = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if tok is None:
        raise GqakitError("The tokenizer has neither a BOS nor an EOS token to start the text with.")
    return int(tok)


def encode_stream(tokenizer, texts: Sequence[str], max_tokens: int | None = None) -> tuple[list[int], int]:
    """Join ``texts``, tokenize, put the prefix token first; return (stream, bytes of the scored text)."""
    text = DOC_SEPARATOR.join(texts)
    ids = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    if not ids:
        raise GqakitError("The evaluation text tokenizes to nothing.")
    n_bytes = len(text.encode("utf-8"))
    if max_tokens is not None and max_tokens < len(ids):
        # The bytes the kept tokens spell, a cut character's kept bytes included (not the whole of it).
        n_bytes = kept_bytes(tokenizer, text, ids, max_tokens)
        ids = ids[:max_tokens]
    return [prefix_token_id(tokenizer), *ids], n_bytes


def _token_nll(logits_of: Callable[[slice], torch.Tensor], targets: torch.Tensor, step: int) -> torch.Tensor:
    """-log p(target) per position, in float32, as ``logsumexp(logits) - logits[target]``, from the logits
    of ``step`` positions at a time (``logits_of(positions)``).

    One pass over the logits without the ``[batch, seq, vocab]`` log-softmax that ``cross_entropy``
    would materialise, and upcast a chunk at a time, so half-precision logits of a long batch never exist
    as one float32 copy (16 windows of 2048 over a 49k vocabulary would be 6 GiB).
    """
    out = torch.empty(targets.shape, dtype=torch.float32, device=targets.device)
    for i in range(0, targets.shape[1], step):
        at = slice(i, i + step)
        logits = logits_of(at).float()
        out[:, at] = torch.logsumexp(logits, dim=-1) - logits.gather(-1, targets[:, at, None]).squeeze(-1)
    return out


class _Scorer:
    """Per-position NLL of a batch of windows, through the output layer a chunk of positions at a time.

    ``model(...).logits`` materialises ``[batch, seq, vocab]`` logits (3 GiB in bf16 for 16 windows of
    2048 over a 49k vocabulary), then the NLL reads them again. Running the decoder alone
    (``model.base_model``) and the output layer on a few thousand positions at a time never holds more
    than one chunk's logits. Some families transform the logits after the output layer (soft-capping,
    scaling), so the first batch goes both ways: the chunked path is used for the rest only where the
    output layer on the decoder's states gives the model's own logits (to rounding).
    """

    ROWS = 4096  # positions (over the whole batch) per output-layer chunk

    def __init__(self, model) -> None:
        self.model = model
        self.can_cut = "logits_to_keep" in inspect.signature(model.forward).parameters
        head, base = model.get_output_embeddings(), getattr(model, "base_model", model)
        self.chunked: bool | None = None if isinstance(head, torch.nn.Linear) and base is not model else False

    def _logits(self, inputs: torch.Tensor, keep: int | None) -> torch.Tensor:
        kwargs = {"logits_to_keep": keep} if keep is not None and self.can_cut else {}
        return self.model(input_ids=inputs, use_cache=False, **kwargs).logits

    def _hidden(self, inputs: torch.Tensor, keep: int | None) -> torch.Tensor:
        hidden = self.model.base_model(input_ids=inputs, use_cache=False).last_hidden_state
        return hidden if keep is None else hidden[:, -keep:]

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, keep: int | None) -> torch.Tensor:
        if self.chunked is None:  # first batch: decide
            logits = self._logits(inputs, keep)
            mine = self.model.get_output_embeddings()(self._hidden(inputs, keep))
            self.chunked = mine.shape == logits.shape and torch.allclose(mine, logits, rtol=1e-3, atol=1e-3)
        elif not self.chunked:
            logits = self._logits(inputs, keep)
        else:
            hidden, head = self._hidden(inputs, keep), self.model.get_output_embeddings()
            step = max(1, self.ROWS // hidden.shape[0])
            return _token_nll(lambda at: head(hidden[:, at]), targets[:, -hidden.shape[1] :], step)
        return _token_nll(lambda at: logits[:, at], targets[:, -logits.shape[1] :], 512)


def windowed_perplexity(
    tokenizer, texts: Sequence[str], score: Callable[[list[int], list[Window]], float], *, seq_len: int,
    stride: int | None = None, max_tokens: int | None = None,
) -> PerplexityResult:  # fmt: skip
    """The perplexity of ``texts`` over their windows (see the module docstring), whatever runs the model.

    Every engine scores the same stream and windows: ``score(stream, windows)`` returns the summed
    negative log-likelihood (nats) of each window's last ``scored`` targets, ``stream[end + 1 - scored :
    end + 1]`` given the tokens before them.
    """
    stride = seq_len if stride is None else stride
    stream, n_bytes = encode_stream(tokenizer, texts, max_tokens)
    windows = sliding_windows(len(stream), seq_len, stride)
    start = time.perf_counter()
    nll_sum = score(stream, windows)
    elapsed, tokens = time.perf_counter() - start, len(stream) - 1
    mean = nll_sum / tokens
    return PerplexityResult(
        ppl=math.exp(mean) if mean < 700 else math.inf,  # exp overflows past 709: a diverged model
        nll=mean,
        bits_per_byte=nll_sum / (math.log(2) * n_bytes),
        tokens=tokens,
        bytes=n_bytes,
        seq_len=seq_len,
        stride=stride,
        nll_sum=nll_sum,
        windows=len(windows),
        documents=len(texts),
        elapsed_s=elapsed,
        tokens_per_s=tokens / elapsed if elapsed > 0 else float("inf"),
    )


@torch.inference_mode()
def perplexity(
    model,
    tokenizer,
    texts: Sequence[str],
    *,
    seq_len: int = 512,
    stride: int | None = None,
    batch_size: int = 8,
    max_tokens: int | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """Token-weighted perplexity and bits per byte of ``model`` (transformers) on ``texts``.

    Args:
        model: a causal LM (any ``AutoModelForCausalLM``), on the device to run on.
        tokenizer: its tokenizer.
        texts: documents; joined with ``"\\n\\n"`` (see the module docstring).
        seq_len: tokens per window; at most the model's maximum positions.
        stride: new tokens scored per window after the first; ``None`` means ``seq_len`` (disjoint
            windows). Smaller strides give each token more context and cost more forward passes.
        batch_size: windows per forward pass.
        max_tokens: score only the first ``max_tokens`` tokens of the text.
        progress: show a progress bar.
    """
    stride = seq_len if stride is None else stride
    sliding_windows(0, seq_len, stride)  # checks seq_len and stride
    if batch_size < 1 or (max_tokens is not None and max_tokens < 1):
        raise GqakitError(f"batch_size and max_tokens must be positive, got {batch_size} and {max_tokens}.")
    check_seq_len(model.config, seq_len)
    if not texts:
        raise GqakitError("No evaluation text was given.")
    device = next(model.parameters()).device
    scorer = _Scorer(model)

    def score(stream: list[int], windows: list[Window]) -> float:
        ids = torch.tensor(stream, dtype=torch.long)
        # The first window scores every prediction; the rest score their last ``stride`` (the final one
        # maybe fewer), so only their last ``stride`` positions go through the output layer.
        # Summed on the device and read once at the end: a .cpu() per window would stall a GPU every batch.
        total = torch.zeros((), dtype=torch.float64, device=device)
        bar = progress_bar(desc="perplexity", total=len(windows), enabled=progress, unit="win")
        for group, keep in [(windows[:1], None), (windows[1:], stride)]:
            for batch in (group[i : i + batch_size] for i in range(0, len(group), batch_size)):
                inputs = torch.stack([ids[w.start : w.end] for w in batch]).to(device)
                targets = torch.stack([ids[w.start + 1 : w.end + 1] for w in batch]).to(device)
                nll = scorer(inputs, targets, keep)
                # Each window scores its last ``scored`` positions: a mask keeps them, with no per-row loop.
                scored = torch.tensor([w.scored for w in batch], device=device)
                cols = torch.arange(nll.shape[1], device=device)
                in_scope = cols[None, :] >= nll.shape[1] - scored[:, None]
                total += torch.where(in_scope, nll, 0.0).sum(dtype=torch.float64)
                bar.update(len(batch))
        bar.close()
        return float(total)  # the one device sync

    return windowed_perplexity(tokenizer, texts, score, seq_len=seq_len, stride=stride, max_tokens=max_tokens)
