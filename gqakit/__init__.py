"""gqakit: convert multi-head-attention checkpoints to grouped-query or multi-query attention."""

__version__ = "0.2.0"
