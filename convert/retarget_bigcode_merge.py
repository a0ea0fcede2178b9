"""The calibrated merge and layer-wise refinement into a ``gpt_bigcode`` MQA target (GPT-2, OPT).

``gpt_bigcode`` holds one K/V head (``multi_query``) or all of them, and its MHA ``c_attn`` rows are
per-head interleaved (``q_h | k_h | v_h`` for each head), which the streaming merge planner of the
registered families does not read. The retargeted families are converted whole in memory anyway, so
this module does the same math on the exact MHA rewrite directly:

* one pass of the MHA model over the calibration tokens records, per layer, the second moment of
  ``c_attn``'s input (and, when refining, each attention block's inputs and outputs);
* the key and value heads of each layer merge into one by the pure functions of
  :mod:`gqakit.convert.merge` (keys without rotary merge like values), in the metric of where their
  errors matter downstream, with the compensation folded into the query rows and ``c_proj``'s columns;
* refinement fits each converted attention block (``GPTBigCodeAttention`` built for the MQA config) to
  the original block's output, as :mod:`gqakit.convert.refine` does for every family.
"""

from __future__ import annotations

from typing import Any

import torch

from gqakit.convert.calibrate import CALIB_BATCH, batch_gram, batches
from gqakit.convert.merge import (
    augment,
    compensate_o_cols,
    compensate_q_rows,
    downstream_scales,
    energy,
    fit_key_merge,
    fit_value_merge,
    in_metric,
    merge_error,
    merge_rows,
)
from gqakit.convert.refine import (
    RefineReport,
    RefineSettings,
    fit_block,
    layer_output,
    split_batches,
    to_float,
)
from gqakit.gguf.tensors import per_head_to_blocks

StateDict = dict[str, torch.Tensor]
Config = dict[str, Any]


def _attn(i: int, name: str, part: str) -> str:
    return f"transformer.h.{i}.attn.{name}.{part}"


def split_heads(t: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """MHA ``c_attn`` rows (weight or bias), per-head interleaved -> q, k, v rows ``[heads * d, ...]``."""
    return per_head_to_blocks(t, heads).chunk(3)


def _hf_config(config: Config) -> Any:
    """The transformers config object of a gpt_bigcode config dict."""
    from transformers import AutoConfig  # deferred: transformers takes seconds to import

    return AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})


def _model(config: Config, state: StateDict, device: torch.device) -> torch.nn.Module:
    # deferred: transformers takes seconds to import
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_hf_config(config), dtype=torch.float32)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:  # the tied head is the only one absent
        raise RuntimeError(f"gpt_bigcode rewrite does not fit its class: {missing} {unexpected}")
    model.tie_weights()
    return model.to(device=device, dtype=torch.float32).eval()


def capture(
    config: Config, state: StateDict, sequences: list[torch.Tensor], refine: bool, device: torch.device
) -> tuple[list[torch.Tensor], list[list[tuple]], list[int], int]:
    """Run the MHA model over ``sequences``: per layer, ``[X, 1]^T [X, 1]`` of ``c_attn``'s input, and
    (when ``refine``) the attention block's float32 ``(args, kwargs, output)`` per batch.

    Returns:
        The grams, the captured batches per layer, the tokens of the batches fitted on and of those held
        out, and how many batches are fitted on (:func:`~gqakit.convert.refine.split_batches`; the
        captured batches come in that order).
    """
    model = _model(config, state, device)
    n = config["n_layer"]
    grams: list[torch.Tensor | None] = [None] * n
    io: list[list[tuple]] = [[] for _ in range(n)]
    handles = []
    for i, block in enumerate(model.transformer.h):

        def gram_hook(_m, args, i=i) -> None:
            g = batch_gram(args[0])
            grams[i] = g if grams[i] is None else grams[i] + g

        def io_hook(_m, args, kwargs, output, i=i) -> None:
            kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "layer_past")}
            io[i].append((to_float(args), to_float(kw), layer_output(output).float()))

        handles.append(block.attn.c_attn.register_forward_pre_hook(gram_hook))
        if refine:
            handles.append(block.attn.register_forward_hook(io_hook, with_kwargs=True))
    fit, check = split_batches(sequences) if refine else (list(batches(sequences, CALIB_BATCH)), [])
    try:
        with torch.no_grad():
            for ids in [*fit, *check]:
                model(input_ids=ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    tokens = [sum(b.numel() for b in fit), sum(b.numel() for b in check)]
    return [g for g in grams if g is not None], io, tokens, len(fit)


def merge_layer(state: StateDict, config: Config, i: int, gram: torch.Tensor) -> tuple[StateDict, dict]:
    """Layer ``i`` of the MHA ``state`` merged into one calibrated K/V head: the new ``c_attn`` (rows
    ``q | k | v``) and ``c_proj`` weights, and the relative output energy the merge lost."""
    heads, hidden = config["n_head"], config["n_embd"]
    d = hidden // heads
    w, b = state[_attn(i, "c_attn", "weight")], state[_attn(i, "c_attn", "bias")]
    (qw, kw, vw), (qb, kb, vb) = split_heads(w, heads), split_heads(b, heads)
    wo = state[_attn(i, "c_proj", "weight")]

    def per_head(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return augment(weight, bias).reshape(heads, d, hidden + 1)

    wq, wk, wv = per_head(qw, qb), per_head(kw, kb), per_head(vw, vb)
    ks, vs = downstream_scales(wq, wo, gram, heads, 0)
    mk = in_metric(lambda x: fit_key_merge(x, gram, 0), wk, ks)
    mv = in_metric(lambda x: fit_value_merge(x, gram), wv, vs)
    out = {
        _attn(i, "c_attn", "weight"): torch.cat(
            [compensate_q_rows(qw, [mk], d, 1), merge_rows(kw, [mk], d), merge_rows(vw, [mv], d)]
        ),
        _attn(i, "c_attn", "bias"): torch.cat(
            [compensate_q_rows(qb, [mk], d, 1), merge_rows(kb, [mk], d), merge_rows(vb, [mv], d)]
        ),
        _attn(i, "c_proj", "weight"): compensate_o_cols(wo, [mv], d, 1),
    }
    errors = {
        "layer": i,
        "key_error": round(merge_error(wk, gram, mk) / max(energy(wk, gram), 1e-300), 6),
        "value_error": round(merge_error(wv, gram, mv) / max(energy(wv, gram), 1e-300), 6),
    }
    return out, errors


def refine_layer(
    state: StateDict, mqa_config: Config, i: int, io: list[tuple], n_fit: int, settings: RefineSettings,
    device: torch.device,
) -> tuple[StateDict, dict]:  # fmt: skip
    """Fit layer ``i``'s converted attention block (weights from ``state``) to the captured outputs."""
    # deferred: transformers takes seconds to import
    from transformers.models.gpt_bigcode.modeling_gpt_bigcode import GPTBigCodeAttention

    block = GPTBigCodeAttention(_hf_config(mqa_config), layer_idx=i).to(device=device, dtype=torch.float32)
    prefix = f"transformer.h.{i}.attn."
    block.load_state_dict(
        {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, strict=True
    )
    fitted = fit_block(block, io[:n_fit], io[n_fit:], settings)
    out = {prefix + k: v.detach().to("cpu", state[prefix + k].dtype) for k, v in block.state_dict().items()}
    return out, {"layer": i, **fitted}


def calibrated_mqa(
    mha: StateDict,
    config: Config,
    sequences: list[torch.Tensor],
    *,
    start: StateDict | None,
    refine: RefineSettings | None,
    device: torch.device,
) -> tuple[StateDict, dict[str, Any]]:
    """The MQA state of the MHA ``mha``: the calibrated merge (``start`` None) or a pooled ``start``,
    refined layer by layer when ``refine`` is given.

    Args:
        mha: the exact gpt_bigcode MHA rewrite of the source: the original every fit is measured against.
        config: its config.
        sequences: calibration token ids.
        start: an MQA state pooled from ``mha`` (mean, first), or None for the calibrated merge.
        refine: refinement settings, or None.
        device: where the model runs.

    Returns:
        The MQA state, and what was measured for gqakit.json (per-layer merge and refinement errors).
    """
    grams, io, (fit_tokens, held_tokens), n_fit = capture(config, mha, sequences, refine is not None, device)
    out = dict(mha if start is None else start)
    record: dict[str, Any] = {}
    if start is None:
        errors = []
        for i, gram in enumerate(grams):
            layer, err = merge_layer(mha, config, i, gram)
            out.update(layer)
            errors.append(err)
        record["reconstruction_error"] = errors
    if refine is not None:
        mqa_config = {**config, "multi_query": True}
        report = RefineReport(refine, fit_tokens, held_tokens)
        for i in range(config["n_layer"]):
            layer, fitted = refine_layer(out, mqa_config, i, io[i], n_fit, refine, device)
            out.update(layer)
            report.layers.append(fitted)
            io[i] = []  # this layer's activations are no longer needed
        record["refine"] = report.to_record()
    return out, record


__all__ = ["calibrated_mqa", "capture", "merge_layer", "refine_layer", "split_heads"]
