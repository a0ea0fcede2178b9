"""The vLLM side of ``gqakit eval --engine vllm``: one checkpoint in ``vllm.LLM``, driven over a pipe in
JSON lines (docs/vllm.md). It runs under the Python that has vLLM, so it imports only vLLM and the
standard library. vLLM logs to stdout: the protocol keeps the real stdout and points file descriptor 1
(inherited by vLLM's engine process) at stderr, which the client collects for its messages.
"""

import json
import os
import random
import sys
import time
import traceback

_PROTOCOL = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr


def _send(obj: dict) -> None:
    _PROTOCOL.write(json.dumps(obj, default=str) + "\n")
    _PROTOCOL.flush()


def _kind(exc: BaseException, default: str = "error") -> str:
    """What went wrong, for the client's message: out of KV memory, or ``default``."""
    kv = any(word in str(exc).lower() for word in ("kv cache", "cache blocks", "memory"))
    return "kv_memory" if kv else default


def _nll(llm, sampling_params_cls, prompt_cls, req: dict) -> dict:
    params = sampling_params_cls(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    prompts = [prompt_cls(prompt_token_ids=w) for w in req["windows"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    # prompt_logprobs[i] maps the actual token at position i (and any top-k) to its logprob given the
    # tokens before it; position 0 has none.
    return {
        "nll": [
            -sum(out.prompt_logprobs[i][window[i]].logprob for i in range(len(window) - scored, len(window)))
            for out, window, scored in zip(outs, req["windows"], req["scored"], strict=True)
        ]
    }


def _throughput(llm, sampling_params_cls, prompt_cls, req: dict, vocab: int) -> dict:
    rng = random.Random(req.get("seed", 0))
    prompts = [
        prompt_cls(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(req["prompt_tokens"])])
        for _ in range(req["concurrency"])
    ]
    n = req["output_tokens"]
    params = sampling_params_cls(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


def main() -> None:
    settings = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings["kv_budget_gib"]))
    try:
        # deferred: after VLLM_CPU_KVCACHE_SPACE is set; a broken install answers a message, no traceback
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as e:  # an install that does not load: its own message
        _send({"error": f"vLLM does not import: {type(e).__name__}: {e}", "kind": "import"})
        return
    share = settings.get("gpu_memory_utilization")
    kwargs = {} if share is None else {"gpu_memory_utilization": share}
    try:
        llm = LLM(
            model=settings["model"],
            dtype=settings["dtype"],
            max_model_len=settings["max_model_len"],
            seed=settings.get("seed", 0),
            enforce_eager=True,
            **kwargs,
        )
    except Exception as e:
        traceback.print_exc()
        _send({"error": f"{type(e).__name__}: {e}", "kind": _kind(e, "load")})
        return
    cache = llm.llm_engine.vllm_config.cache_config  # the KV cache holds blocks x block size tokens
    blocks = getattr(cache, "num_gpu_blocks", None) or getattr(cache, "num_cpu_blocks", None)
    kv_tokens, size = (blocks * cache.block_size if blocks else None), cache.block_size
    vocab = llm.llm_engine.model_config.get_vocab_size()
    _send({"ready": True, "kv_tokens": kv_tokens, "block_size": size, "vllm_version": vllm.__version__})
    ops = {
        "nll": lambda r: _nll(llm, SamplingParams, TokensPrompt, r),
        "throughput": lambda r: _throughput(llm, SamplingParams, TokensPrompt, r, vocab),
    }
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "quit":
            break
        try:
            _send(ops[req["op"]](req))
        except Exception as e:
            traceback.print_exc()
            _send({"error": f"{type(e).__name__}: {e}", "kind": _kind(e)})


if __name__ == "__main__":
    main()
