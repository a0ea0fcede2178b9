"""Orchestration above the verbs: cached, keyed, resumable pipelines (``demo``, ``probe``, ``replicate``,
``recovery``), one package each, on the shared ``store``, ``steps`` and ``starts``
(docs/architecture.md). The verbs never import this package.

This file imports nothing, so ``gqakit --help`` stays light.
"""
