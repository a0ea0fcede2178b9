"""GGUF files: reading their header and Hugging Face config (:mod:`.header`), exporting gqakit's
checkpoints for llama.cpp (:mod:`.export`), and reading a ``.gguf`` as a checkpoint (:mod:`.dequantize`).

The package imports nothing itself: each family's GGUF layout (:mod:`.arch`) is part of
:data:`gqakit.families.FAMILIES`, which the rest of this package reads.
"""
