"""MHA -> GQA/MQA conversion: pure pooling functions, architecture adapters, streaming checkpoint I/O."""

from gqakit.convert.api import ConvertOptions, convert_checkpoint, expand_checkpoint, inspect_checkpoint
from gqakit.convert.options import PRESETS
from gqakit.convert.plan import RegroupSpec, convert_state_dict
from gqakit.families import ADAPTERS, get_adapter

__all__ = [
    "ADAPTERS",
    "PRESETS",
    "ConvertOptions",
    "RegroupSpec",
    "convert_checkpoint",
    "convert_state_dict",
    "expand_checkpoint",
    "get_adapter",
    "inspect_checkpoint",
]
