"""A stand-in for eval/vllm_worker.py that needs no vLLM: the same JSON-lines protocol, answered with
transformers, so the client, the engine, the report and the demo's column are tested without vLLM.

It scores what the real worker scores (each prompt token given the ones before it), allocates a "paged"
KV cache of whole 16-token blocks in the budget, and fails on request: a model directory whose name
contains ``cannot-load`` fails to load; ``STANDIN_FAIL=kv_memory`` fails as out of KV memory;
``STANDIN_FAIL=engine_process`` fails as vLLM's front end does when its engine process ran out of KV memory
(the cause in the log, "See root cause above" in the reply).
"""

import json
import os
import random
import sys
import time

import torch
from transformers import AutoModelForCausalLM

BLOCK = 16


def _send(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


@torch.inference_mode()
def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids, out = list(prompt), []
    for _ in range(n):  # no cache: a different path from the engine's reference
        out.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        ids.append(out[-1])
    return out


@torch.inference_mode()
def _nll(model, window: list[int], scored: int) -> float:
    logp = torch.log_softmax(model(torch.tensor([window])).logits[0].double(), -1)
    return -sum(float(logp[i - 1, window[i]]) for i in range(len(window) - scored, len(window)))


def main() -> None:
    settings = json.loads(sys.argv[1])
    if os.environ.get("STANDIN_FAIL") == "engine_process":
        print(
            "(EngineCore pid=1) ERROR [core.py:1] ValueError: To serve at least one request with the model's "
            "max seq len (8192), (1.05 GiB KV cache is needed, which is larger than the available KV cache "
            "memory (0.98 GiB).",
            file=sys.stderr,
        )
        sys.stderr.flush()
        _send(
            {
                "error": "RuntimeError: Engine core initialization failed. See root cause above.",
                "kind": "load",
            }
        )
        return
    if "cannot-load" in settings["model"] or os.environ.get("STANDIN_FAIL") == "kv_memory":
        print("ValueError: standing in for a failure", file=sys.stderr)
        kind = "kv_memory" if os.environ.get("STANDIN_FAIL") == "kv_memory" else "load"
        error = "ValueError: not enough KV cache memory" if kind == "kv_memory" else "ValueError: bad weights"
        _send({"error": error, "kind": kind})
        return
    dtype = getattr(torch, settings["dtype"])
    model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=dtype).eval()
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * dtype.itemsize
    blocks = int(settings["kv_budget_gib"] * 2**30) // (per_token * BLOCK)
    _send({"ready": True, "kv_tokens": blocks * BLOCK, "block_size": BLOCK, "vllm_version": "stand-in"})
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        if req["op"] == "nll":
            _send({"nll": [_nll(model, w, k) for w, k in zip(req["windows"], req["scored"], strict=True)]})
        elif req["op"] == "throughput":
            rng = random.Random(req["seed"])
            prompts = [[rng.randrange(3, c.vocab_size) for _ in range(req["prompt_tokens"])]]
            start = time.perf_counter()
            for _ in range(req["concurrency"]):
                _greedy(model, prompts[0], req["output_tokens"])
            seconds = time.perf_counter() - start
            _send({"seconds": seconds, "output_tokens": req["concurrency"] * req["output_tokens"]})
        else:
            _send({"error": f"unknown op {req['op']}", "kind": "error"})


if __name__ == "__main__":
    main()
