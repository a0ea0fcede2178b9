"""Shared by the vLLM tests: whether a real vLLM interpreter is at hand (the slow tests skip without one)."""

from __future__ import annotations

import pytest

from gqakit.errors import GqakitError
from gqakit.eval.vllm_engine import require_vllm


def real_vllm_python() -> str | None:
    """The interpreter with vLLM (``$GQAKIT_VLLM_PYTHON``, or this one when it imports vLLM), else None."""
    try:
        return require_vllm()
    except GqakitError:
        return None


needs_vllm = pytest.mark.skipif(
    real_vllm_python() is None, reason="needs vLLM ($GQAKIT_VLLM_PYTHON or importable)"
)
