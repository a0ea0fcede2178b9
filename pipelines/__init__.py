"""Orchestration above the verbs: cached, keyed, resumable pipelines (``demo``, ``probe``, ``replicate``,
``recovery``).

The verbs (``gqakit.convert``, ``gqakit.eval``, ``gqakit.uptrain``) never import this package.

Each pipeline is a package whose public names are importable from it: ``gqakit.pipelines.demo``
(``run_demo``, ``DemoOptions``, ``demo_cmd``, ...), ``gqakit.pipelines.probe`` (``probe_checkpoint``,
``ProbeOptions``, ``probe_cmd``, ...), ``gqakit.pipelines.replicate`` (``run_replicate``,
``ReplicateOptions``, ...) and ``gqakit.pipelines.recovery`` (``run_recovery``, ``RecoveryOptions``,
...). Inside each, the parts have the same names: ``options``, ``run`` (the pipeline and its click
command), ``report``, and what that pipeline needs besides (the demo's
``measure`` and ``decode``, replicate's ``train``). What every pipeline shares sits here:

* :mod:`gqakit.pipelines.store`: :class:`~gqakit.pipelines.store.ResultStore`, results on disk keyed
  by the settings and the models' fingerprints, so a rerun reuses and an interrupted run resumes;
* :mod:`gqakit.pipelines.steps`: the options every pipeline takes (``PipelineOptions``) and their checks, one
  ``[k/N] title`` line per step, quiet libraries, and the working directory held with its store;
* :mod:`gqakit.pipelines.starts`: starts named by a convert preset or method, and ``--set
  model.convert.*`` settings passed to the starts that use them;
* :mod:`gqakit.pipelines.run_keys`: an uptraining run, cached and resumed by its recipe less the
  sections that do not change its weights;
* :mod:`gqakit.pipelines.reporting`: figures written with Agg (log axes where values span orders of
  magnitude), numbers and tables formatted, report files written atomically.

This file imports nothing, so ``gqakit --help`` stays light.
"""
