"""``gqakit probe``: zero-training quality of each G x method, before any compute is spent (docs/probe.md)."""

from gqakit.pipelines.probe.options import ProbeOptions
from gqakit.pipelines.probe.report import ProbeResult, ProbeRow
from gqakit.pipelines.probe.run import attention_errors, probe_checkpoint, probe_cmd

__all__ = ["ProbeOptions", "ProbeResult", "ProbeRow", "attention_errors", "probe_checkpoint", "probe_cmd"]
