"""GGUF files: reading their header and Hugging Face config (:mod:`.header`), exporting checkpoints for
llama.cpp (:mod:`.export`), reading a ``.gguf`` as a checkpoint (:mod:`.dequantize`). Each family's GGUF
layout (:mod:`.arch`) is part of :data:`gqakit.families.FAMILIES`.
"""
