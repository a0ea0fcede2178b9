"""The engines of ``gqakit eval --engine``: where each model is measured, defined once.

Each entry names the function that measures one model and returns a
:class:`~gqakit.eval.results.ModelResult` (``measure(label, path, *, config, options, texts, contexts)``:
the model's name in tables, its checkpoint directory or hub id, its transformers config, the
:class:`~gqakit.eval.options.EvalOptions`, the perplexity texts or None, the decode contexts that fit it),
the check that its backend is installed, and what it can do. :func:`gqakit.eval.api.evaluate_models`
runs every model through the engine's ``measure``; the CLI's ``--engine`` choices and help, and the
option checks, read this table. A new engine is a module in ``eval/`` and one entry here.

The functions are named as ``"module:function"`` and imported when the engine runs, so listing the
engines imports no backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gqakit.names import NameTable, resolve


@dataclass(frozen=True)
class Engine:
    """One ``--engine``.

    Attributes:
        summary: one line for help texts and docs.
        measure: ``"module:function"`` measuring one model (see the module docstring).
        requires: ``"module:function"`` that raises a :class:`~gqakit.errors.GqakitError` with the install
            command when the backend is missing; None: nothing beyond gqakit's own dependencies.
        tasks: runs lm-eval tasks (``--tasks``).
    """

    summary: str
    measure: str
    requires: str | None = None
    tasks: bool = False

    def measure_fn(self) -> Callable[..., Any]:
        """The function that measures one model."""
        return resolve(self.measure)

    def check_installed(self, options: Any = None) -> None:
        """Raise a clear error when this engine's backend is not installed (``options``: the
        :class:`~gqakit.eval.options.EvalOptions`, which may say where the backend is)."""
        if self.requires:
            resolve(self.requires)(options)


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
