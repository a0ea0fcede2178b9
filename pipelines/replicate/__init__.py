"""``gqakit replicate``: the GQA paper's experiments, re-run end to end on a multi-head model trained here,
cached in ``--work-dir`` (docs/replicate.md)."""

from gqakit.pipelines.replicate.options import ModelShape, ReplicateOptions
from gqakit.pipelines.replicate.run import ReplicateResult, pretrain_mha, replicate_cmd, run_replicate

__all__ = [
    "ModelShape",
    "ReplicateOptions",
    "ReplicateResult",
    "pretrain_mha",
    "replicate_cmd",
    "run_replicate",
]
