"""Devices by their model, for the keys of measurements that depend on the hardware (decode timings):
a working directory moved to another GPU or CPU model measures them again."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    """A device by its model: ``cuda: NVIDIA H100 80GB HBM3``, or ``cpu: <model>, <n> CPUs`` (the CPUs this
    process may run on: the threads a decode gets)."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{device.type}: {_cpu_model()}, {cpus} CPUs"


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, where ``platform.processor()`` is often empty)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timing_device(device: str) -> str:
    """:func:`device_name` of a pipeline's ``--device`` (``auto``: CUDA when present, else the CPU)."""
    # deferred: gqakit.models imports transformers
    from gqakit.models import resolve_device

    return device_name(resolve_device(device))


__all__ = ["device_name", "timing_device"]
