"""ckpt-audit: keeps large-model training checkpoints honest."""

__version__ = "0.1.0"
