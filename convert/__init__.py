"""MHA -> GQA/MQA conversion: pure pooling functions, architecture adapters, streaming checkpoint I/O."""

from gqakit.convert.api import (
    ConvertOptions,
    ConvertResult,
    Inspection,
    convert_checkpoint,
    expand_checkpoint,
    inspect_checkpoint,
)
from gqakit.convert.options import PRESETS, Preset
from gqakit.convert.plan import RegroupSpec, convert_state_dict, plan_regroup
from gqakit.convert.pooling import regroup, regroup_fused_qkv, regroup_head_axis
from gqakit.families import ADAPTERS, get_adapter
from gqakit.family_parts import ArchAdapter

__all__ = [
    "ADAPTERS",
    "PRESETS",
    "ArchAdapter",
    "ConvertOptions",
    "ConvertResult",
    "Inspection",
    "Preset",
    "RegroupSpec",
    "convert_checkpoint",
    "convert_state_dict",
    "expand_checkpoint",
    "get_adapter",
    "inspect_checkpoint",
    "plan_regroup",
    "regroup",
    "regroup_fused_qkv",
    "regroup_head_axis",
]
