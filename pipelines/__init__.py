"""Orchestration above the verbs: cached, keyed, resumable pipelines (``demo``, ``probe``, ``replicate``).

The verbs (``gqakit.convert``, ``gqakit.eval``, ``gqakit.uptrain``) never import this package.
"""
