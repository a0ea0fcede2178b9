"""``gqakit recovery``: how many uptraining tokens each start needs to reach the original's quality.

::

    [1/N] inputs      SRC (a directory, hub id or asset), the groups checked, the text split three ways
    [2/N] original    its held-out perplexity, measured as every point of every curve is
    [k/N] start       convert SRC from the start, then one uptraining run (distillation from SRC by
                      default) evaluated on the held-out text at log-spaced token counts
    [N/N] report      recovery.png, report.md (tokens to reach 2x ... 1.05x, savings), results.json

Every conversion, run and measurement is cached in ``--work-dir`` (:class:`~gqakit.pipelines.store.
ResultStore`), keyed by what it depends on (not by logging, speed levers or checkpoint cadence), so a
second run takes seconds; a killed run resumes from its last checkpoint.

The package's parts: ``options``, ``curves`` (pure: evaluation steps, thresholds, savings), ``run``
(the pipeline and its click command) and ``report``.
"""

from gqakit.pipelines.recovery.options import RecoveryOptions
from gqakit.pipelines.recovery.run import RecoveryResult, recovery_cmd, run_recovery

__all__ = ["RecoveryOptions", "RecoveryResult", "recovery_cmd", "run_recovery"]
