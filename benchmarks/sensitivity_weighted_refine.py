"""A probe of a sensitivity-weighted refinement loss: each layer's output error weighted, per token and
channel, by the squared gradient of the original model's next-token loss at that output (an empirical
Fisher diagonal, as BRECQ weights block reconstruction: Li et al. 2021), against the ``per-token`` loss.

A layer-wise refinement spends its capacity evenly over the residual stream; what matters downstream is
the error in the directions the logits are sensitive to. This converts SOURCE with the calibrated merge
and a whole-layer refinement target twice, once with each weighting, and scores both on held-out text
(convert.md's protocol). The weights are computed once from the original model loaded whole (memory:
the model, plus layers x calibration tokens x hidden floats), so this is a probe for models that fit,
not a conversion mode::

    C=${GQAKIT_CACHE:-~/.cache/gqakit}
    python benchmarks/sensitivity_weighted_refine.py $C/smollm2-135m/model OUT_DIR --groups 1 \\
        --calib-data $C/wiki-en/train.txt --calib-tokens 4096 --refine-steps 100 \\
        --eval-data $C/wiki-en/test.txt

Each conversion runs in this process with the package's own code; the sensitivity weights replace what
the ``per-token`` loss would use (``_LayerwiseJob._token_weights``), nothing else changes. Figures are
printed with this command line.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from gqakit.convert.refine_names import REFINE_TARGETS

NAMES = ("per-token", "sensitivity", "channel")


def sensitivity(model_path: str, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per decoder layer, ``[tokens, hidden]``: the squared gradient of the original's summed next-token
    loss at that layer's output, over ``sequences`` in order (one sequence per backward pass)."""
    from gqakit.models import load_causal_lm

    model = load_causal_lm(model_path, dtype="float32", device="cpu").eval()
    layers = model.model.layers
    outputs: list[torch.Tensor] = []

    def keep(_module, _args, out):
        h = out[0] if isinstance(out, tuple) else out
        h.retain_grad()
        outputs.append(h)

    hooks = [layer.register_forward_hook(keep) for layer in layers]
    per_layer: list[list[torch.Tensor]] = [[] for _ in layers]
    try:
        for ids in sequences:
            outputs.clear()
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids.view(1, -1), labels=ids.view(1, -1)).loss * (ids.numel() - 1)
            loss.backward()
            for i, h in enumerate(outputs):
                per_layer[i].append(h.grad.detach()[0].pow(2))
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(g) for g in per_layer]


def convert(src: str, dst: Path, options, weights: list[torch.Tensor] | None, channel: bool = False) -> float:
    """Convert with the package's code; with ``weights``, the refinement's per-token weights become the
    sensitivity weights of the layer being refined (``channel``: the per-token weights times each
    channel's mean sensitivity, so only the direction of the error is reweighted). Returns the wall
    time."""
    from gqakit.convert import convert_checkpoint, layerwise

    job = layerwise._LayerwiseJob
    original_convert, original_weights = job.convert_layer, job._token_weights

    def convert_layer(self, i):
        self._probe_layer = i
        return original_convert(self, i)

    def token_weights(self, pairs):
        g = weights[self._probe_layer]
        if channel:  # the per-token loss's weights, times each channel's mean over the calibration tokens
            per_channel = g.mean(0) / g.mean()
            return [w * per_channel for w in original_weights(self, pairs)]
        floor = g.mean() * 1e-3  # no channel of no token is ignored outright
        out, start = [], 0
        for _, _, target in pairs:  # the batches cover the sequences in order (fit, then held out)
            n = target.shape[0] * target.shape[1]
            out.append((g[start : start + n] + floor).view_as(target))
            start += n
        if start != g.shape[0]:
            raise RuntimeError(f"the refinement batches hold {start} tokens, the weights {g.shape[0]}")
        return out

    if weights is not None:
        job.convert_layer, job._token_weights = convert_layer, token_weights
    try:
        t0 = time.perf_counter()
        convert_checkpoint(src, dst, options, progress=False)
        return time.perf_counter() - t0
    finally:
        job.convert_layer, job._token_weights = original_convert, original_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--calib-data", required=True)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--refine-steps", type=int, default=100)
    # the weights are gradients at a decoder layer's output: only targets fitted to that output
    whole_layer = REFINE_TARGETS.where(lambda t: t.whole_layer and not t.window)
    ap.add_argument("--refine-target", default="layer-corrective", choices=whole_layer)
    ap.add_argument("--eval-data", required=True)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--only", choices=NAMES, help="run one of them")
    args = ap.parse_args()

    from gqakit.checkpoint import resolve_checkpoint
    from gqakit.convert import ConvertOptions
    from gqakit.convert.calibrate import calibration_sequences
    from gqakit.errors import GqakitError
    from gqakit.eval import perplexity
    from gqakit.models import load_causal_lm, load_tokenizer
    from gqakit.text import load_texts

    options = ConvertOptions(
        groups=args.groups, method="calibrated", calib_data=args.calib_data, calib_tokens=args.calib_tokens,
        device="cpu", refine_steps=args.refine_steps, refine_target=args.refine_target,
        refine_loss="per-token", force=True,
    )  # fmt: skip
    texts = load_texts(args.eval_data)

    def ppl(path: str) -> float:
        model = load_causal_lm(path, dtype="float32", device="cpu")
        res = perplexity(
            model, load_tokenizer(path), texts, seq_len=args.seq_len, max_tokens=args.eval_tokens,
            progress=False,
        )  # fmt: skip
        return res.ppl

    rows = []
    grads: list[torch.Tensor] | None = None  # computed once, for the first variant that needs them
    try:  # a missing model or text: gqakit's one-line message, not a traceback
        base = ppl(args.source)
        for name in NAMES:
            if args.only and name != args.only:
                continue
            weights_s = 0.0
            if name != "per-token" and grads is None:
                t0 = time.perf_counter()
                with resolve_checkpoint(args.source) as ckpt:
                    sequences = calibration_sequences(ckpt, args.calib_data, args.calib_tokens)
                grads = sensitivity(args.source, sequences)
                weights_s = time.perf_counter() - t0
            weights = None if name == "per-token" else grads
            seconds = convert(args.source, args.out_dir / name, options, weights, channel=name == "channel")
            value = ppl(str(args.out_dir / name))
            rows.append((name, value, seconds, weights_s))
            print(f"{name}: {value:.3f} ({value / base:.3f}x), {seconds:.0f} s", file=sys.stderr, flush=True)
    except GqakitError as e:
        sys.exit(f"Error: {e.message}")
    print("python " + shlex.join(sys.argv))
    print(f"original {base:.3f}; {args.eval_tokens} tokens of {args.eval_data}, seq_len {args.seq_len}")
    print("| refinement loss | perplexity | x original | conversion | weights |")
    print("|---|---:|---:|---:|---:|")
    for name, value, seconds, weights_s in rows:
        print(f"| {name} | {value:.3f} | {value / base:.3f}x | {seconds:.0f} s | {weights_s:.0f} s |")


if __name__ == "__main__":
    main()
