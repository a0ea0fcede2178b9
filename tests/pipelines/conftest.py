"""Fixtures of the pipeline tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def gpu_machine(monkeypatch):
    """accelerate's view of a machine with a CUDA GPU (``torch.cuda.is_available`` says there is one; a
    model sent there fails), its process state made afresh before and after."""
    # deferred: accelerate takes seconds to import
    from accelerate import PartialState

    PartialState._reset_state()
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    yield
    monkeypatch.undo()
    PartialState._reset_state()
