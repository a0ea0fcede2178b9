"""``gqakit probe``: zero-training quality of each G x method x grouping, before any compute is spent.

For every combination the probe converts the source into a temporary directory (the same code path as
``gqakit convert``), loads it, and measures

* held-out perplexity (``gqakit.eval.perplexity``), next to the original's;
* per-layer attention-output reconstruction error: the original model runs over held-out text, and a
  forward hook on each layer's attention feeds the *same* inputs to the converted layer's attention,
  accumulating ``||out' - out||^2 / ||out||^2``. Errors do not compound across layers, so each number
  says what that layer's merge costs.

Results go to ``OUT/probe.json``,
``OUT/probe.md`` (the table, and the KV cache per GPU under tensor parallelism at each G) and
``OUT/probe.png`` (``report``); the options are in ``options``, the click command in ``run``. The probe
converts, then evaluates, so it sits above both verbs.
"""

from gqakit.pipelines.probe.options import ProbeOptions
from gqakit.pipelines.probe.report import ProbeResult, ProbeRow
from gqakit.pipelines.probe.run import attention_errors, probe_checkpoint, probe_cmd

__all__ = ["ProbeOptions", "ProbeResult", "ProbeRow", "attention_errors", "probe_checkpoint", "probe_cmd"]
