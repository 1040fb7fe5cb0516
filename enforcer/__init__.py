"""vram-enforcer: per-container GPU memory limits for shared GPUs."""

__version__ = "0.2.0"
