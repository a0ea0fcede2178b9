"""GGUF files: reading their header, and exporting gqakit's checkpoints for llama.cpp."""
