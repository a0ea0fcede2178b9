"""``gqakit demo``: the whole story on a real pretrained model, offline, in minutes (docs/demo.md).

The asset step is a parameter (:attr:`DemoOptions.assets`), so tests run the same pipeline on a tiny
model; another conversion adds a row of the table by adding a
:class:`~gqakit.pipelines.demo.options.Variant` to ``VARIANTS``.
"""

from gqakit.pipelines.demo.measure import ModelEval
from gqakit.pipelines.demo.options import DemoAssets, DemoOptions
from gqakit.pipelines.demo.report import render_table
from gqakit.pipelines.demo.run import DemoResult, demo_cmd, run_demo

__all__ = [
    "DemoAssets",
    "DemoOptions",
    "DemoResult",
    "ModelEval",
    "demo_cmd",
    "render_table",
    "run_demo",
]
