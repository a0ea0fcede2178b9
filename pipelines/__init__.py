"""Orchestration above the verbs: cached, keyed, resumable pipelines (``demo``, ``probe``, ``replicate``).

The verbs (``gqakit.convert``, ``gqakit.eval``, ``gqakit.uptrain``) never import this package.

Each pipeline's public names are importable from its module: ``gqakit.pipelines.demo`` (``run_demo``,
``DemoOptions``, ``demo_cmd``, ...) and ``gqakit.pipelines.probe`` (``probe_checkpoint``,
``ProbeOptions``, ``probe_cmd``, ...); the parts they are built from sit beside them (``demo_options``,
``demo_measure``, ``demo_report``, ``demo_cli``; ``probe_report``, ``probe_cli``). What every pipeline
shares:

* :mod:`gqakit.pipelines.store`: :class:`~gqakit.pipelines.store.ResultStore`, results on disk keyed
  by the settings and the models' fingerprints, so a rerun reuses and an interrupted run resumes;
* :mod:`gqakit.pipelines.steps`: ``[k/N] title ... done in X s`` progress lines;
* :mod:`gqakit.pipelines.reporting`: figures written with Agg, perplexities and durations formatted.

This file imports nothing, so ``gqakit --help`` stays light.
"""
