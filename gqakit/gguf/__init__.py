"""GGUF files: reading their header, and exporting gqakit's checkpoints for llama.cpp.

``export_gguf(src, dst, out_type)`` writes a checkpoint (MHA, GQA or MQA) with its tokenizer as a GGUF
file llama.cpp loads; ``read_gguf_header(path)`` reads a GGUF's geometry without touching its weights.
"""

from gqakit.gguf.arch import ARCHS, get_arch
from gqakit.gguf.export import ExportResult, export_gguf
from gqakit.gguf.header import GgufHeader, read_gguf_header
from gqakit.gguf.tensors import OUT_TYPES, ggml_to_hf_rotary, hf_to_ggml_rotary

__all__ = [
    "ARCHS",
    "OUT_TYPES",
    "ExportResult",
    "GgufHeader",
    "export_gguf",
    "get_arch",
    "ggml_to_hf_rotary",
    "hf_to_ggml_rotary",
    "read_gguf_header",
]
