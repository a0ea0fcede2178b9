"""The engines of ``gqakit eval --engine``: where each model is measured, defined once. Each names its
functions as ``"module:function"``, imported when the engine runs, so listing the engines imports no backend.
"""

from __future__ import annotations

from dataclasses import dataclass

from gqakit.names import NameTable


@dataclass(frozen=True)
class Engine:
    """One ``--engine``."""

    summary: str  # one line for help texts and docs.
    # ``"module:function"``: ``measure(label, path, *, config, options, texts, contexts)`` -> ModelResult.
    measure: str
    # ``"module:function"`` that raises a :class:`~gqakit.errors.GqakitError` with the install command when
    # the backend is missing; None: nothing beyond gqakit's own dependencies.
    requires: str | None = None
    tasks: bool = False  # runs lm-eval tasks (``--tasks``).


ENGINES: NameTable[Engine] = NameTable(
    "eval engine",
    {
        "hf": Engine("transformers in this process", "gqakit.eval.hf_engine:measure_hf_model", tasks=True),
        "llamacpp": Engine(
            "llama.cpp on a GGUF export of each model (cached), decode at batch 1; "
            'pip install -e ".[llamacpp]"',
            "gqakit.eval.llamacpp_engine:measure_llamacpp_model",
            requires="gqakit.eval.llamacpp_engine:require_llama_cpp",
        ),
        "vllm": Engine(
            "vLLM in its own Python (--set vllm_python=PATH or $GQAKIT_VLLM_PYTHON): serving KV capacity, "
            "throughput per concurrency",
            "gqakit.eval.vllm_engine:measure_vllm_model",
            requires="gqakit.eval.vllm_engine:require_vllm",
        ),
    },
)
