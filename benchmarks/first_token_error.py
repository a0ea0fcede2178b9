"""Where a converted model's per-layer error sits: the first token's share of each decoder layer's squared
output error and of its output's square, each layer fed the original's hidden states (what whole-layer
refinement fits).

Models such as SmolLM2 hold the first token of a sequence at a far larger size than the rest from some
layer on (a "massive activation": in SmolLM2-135M, from layer 11's output, at about 170 times the median
token's RMS). Under ``--refine-loss relative`` a decoder layer's error is its squared error over its output's
square, summed over the batch, so such a token weighs by its size; ``--refine-loss per-token`` weighs each
token by its error over its own state's mean square. This prints, per layer, the first token's share of
the squared error, of the output's square, and its RMS against the median token's:

    C=${GQAKIT_CACHE:-~/.cache/gqakit}
    python benchmarks/first_token_error.py $C/smollm2-135m/model CONVERTED --text $C/wiki-en/test.txt

The figures are printed with this command line.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch


def _layer_out(out):
    return out[0] if isinstance(out, tuple) else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("original")
    ap.add_argument("converted")
    ap.add_argument("--text", required=True, help="a .txt file; its first tokens are the sequences")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--sequences", type=int, default=4)
    args = ap.parse_args()

    from gqakit.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(args.original)
    original = load_causal_lm(args.original, dtype="float32", device="cpu").eval()
    converted = load_causal_lm(args.converted, dtype="float32", device="cpu").eval()
    n = args.seq_len * args.sequences
    text = open(args.text, encoding="utf-8").read()[: 40 * n]
    ids = torch.tensor(tok(text)["input_ids"][:n]).reshape(args.sequences, args.seq_len)
    kwargs: dict = {}
    first = original.model.layers[0]
    hook = first.register_forward_hook(lambda m, a, kw, o: kwargs.update(kw), with_kwargs=True)
    with torch.no_grad():
        hidden = original(ids, output_hidden_states=True, use_cache=False).hidden_states
    hook.remove()
    kwargs = {k: v for k, v in kwargs.items() if k != "past_key_values"}  # the same for every layer
    print("python " + " ".join(shlex.quote(a) for a in sys.argv))
    print("| layer | first token's share of the squared error | of the output's square | its RMS / median |")
    print("|---:|---:|---:|---:|")
    with torch.no_grad():
        layers = zip(original.model.layers, converted.model.layers, strict=True)
        for i, (a, b) in enumerate(layers):
            want = _layer_out(a(hidden[i], **kwargs))
            err = (_layer_out(b(hidden[i], **kwargs)) - want).pow(2).sum(-1)
            size = want.pow(2).sum(-1)
            shares = float(err[:, 0].sum() / err.sum()), float(size[:, 0].sum() / size.sum())
            rms = size.sqrt()
            ratio = float(rms[:, 0].mean() / rms[:, 1:].median())
            print(f"| {i} | {shares[0]:.3f} | {shares[1]:.3f} | {ratio:.1f} |")


if __name__ == "__main__":
    main()
