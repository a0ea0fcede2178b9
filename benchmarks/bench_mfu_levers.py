"""The speed levers in a minimal training loop, outside gqakit: what each is worth on its own.

A TinyLlama-1.1B-shaped random llama (transformers' own class, sdpa attention), batch 4 x 2048, bf16
autocast over float32 weights, fused AdamW, gradient clipping; the loss either from the full logits
(``F.cross_entropy``), from chunks of the last hidden states with recomputation (``chunkce``), or
liger-kernel's fused linear cross-entropy inside its patched forward (``liger``, which also patches
RMSNorm, RoPE and SwiGLU). ``compile`` wraps the whole model (or, with ``chunkce``, its decoder) in
``torch.compile``; ``cudnn`` forces the cuDNN sdpa backend. Each configuration runs in its own process:
24 steps, the median step after 8. MFU = 6 x parameters x tokens/s over 989 TFLOP/s. Needs a CUDA GPU
(and ``pip install liger-kernel`` for the liger rows). gqakit's own loop with the same levers is
``benchmarks/bench_uptrain.py --rows ...``.

    python benchmarks/bench_mfu_levers.py OUT.json \\
        base,liger,compile,compile_chunkce,liger_compile,compile_cudnn
"""

import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = [
    "base",
    "cudnn",
    "liger",
    "compile",
    "compile_chunkce",
    "liger_compile",
    "compile_cudnn",
    "compile_chunkce_cudnn",
]


def one(name: str, steps: int = 24, warm: int = 8) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    if "liger" in name:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=True
        )
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, 32000, (4, 2048), device="cuda")
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)

    decoder = model.model
    if "compile" in name:
        if "chunkce" in name:
            decoder = torch.compile(model.model)
        else:
            model = torch.compile(model)

    def chunk_ce(h, w, y, chunk=1024):
        h = h.flatten(0, 1)
        y = y.flatten()
        total = h.new_zeros((), dtype=torch.float32)
        for s in range(0, h.shape[0], chunk):

            def f(hh, yy):
                return F.cross_entropy((hh @ w.t()).float(), yy, ignore_index=-100, reduction="sum")

            total = total + torch.utils.checkpoint.checkpoint(
                f, h[s : s + chunk], y[s : s + chunk], use_reentrant=False
            )
        return total / (y != -100).sum()

    def loss_fn():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if "liger" in name:
                return model(input_ids=ids, labels=ids).loss
            if "chunkce" in name:
                h = decoder(input_ids=ids).last_hidden_state
                return chunk_ce(h, model.lm_head.weight, labels)
            logits = model(input_ids=ids).logits
            return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    ctx = None
    if "cudnn" in name:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = sdpa_kernel([SDPBackend.CUDNN_ATTENTION])
        ctx.__enter__()
    times, losses = [], []
    torch.cuda.synchronize()
    last = time.perf_counter()
    for _ in range(steps):
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        now = time.perf_counter()
        times.append(now - last)
        last = now
    med = statistics.median(times[warm:])
    tps = 4 * 2048 / med
    return {
        "name": name,
        "params": n,
        "step_ms": round(med * 1e3, 1),
        "tokens_s": round(tps),
        "mfu": round(6 * n * tps / 989e12, 4),
        "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20),
        "first_step_s": round(times[0], 1),
        "losses": [round(x, 4) for x in losses],
    }


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print("RESULT " + json.dumps(one(sys.argv[2])), flush=True)
        sys.exit(0)
    out = sys.argv[1]
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else CONFIGS
    rows = []
    for name in names:
        t0 = time.time()
        try:
            p = subprocess.run(
                [sys.executable, __file__, "--one", name],
                capture_output=True,
                text=True,
                timeout=int(os.environ.get("MFU_TIMEOUT", "150")),
            )
            res = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
            if res:
                rows.append(res[0])
                r = res[0]
                print(
                    f"{name:24s} {r['step_ms']:7.1f} ms {r['tokens_s']:8,d} tok/s MFU {r['mfu']:.1%} "
                    f"peak {r['peak_mib']:,} MiB first {r['first_step_s']} s ({time.time() - t0:.0f} s)",
                    flush=True,
                )
            else:
                print(f"{name}: FAILED rc={p.returncode}\n{p.stderr[-1500:]}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"{name}: TIMEOUT", flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
