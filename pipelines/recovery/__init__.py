"""``gqakit recovery``: how many uptraining tokens each start needs to reach the original's quality,
cached and resumable in ``--work-dir`` (docs/recovery.md)."""

from gqakit.pipelines.recovery.options import RecoveryOptions
from gqakit.pipelines.recovery.run import RecoveryResult, recovery_cmd, run_recovery

__all__ = ["RecoveryOptions", "RecoveryResult", "recovery_cmd", "run_recovery"]
